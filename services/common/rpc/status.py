"""One error <-> status table for both ends of the internal services (drafter, speculator).

The drafter and the speculator expose the same drafting errors (sssd.common.drafting.proposer)
and map them the same way: a servicer runs the core's call under `call_or_abort`, and a client
turns the status back with `python_error`, so each end raises what the in-process object would.
A service adds its own rows (`extra`) for errors only it has.

NOT_FOUND carries the unknown sequence ids in its details, in the form drafter.proto and
speculator.proto document: the literal prefix `unknown seq_ids ` followed by a JSON array of
every unknown id of the request, so the caller can re-send exactly those with their full
context.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from sssd.common.drafting.proposer import CapacityError, SequenceNotFound

T = TypeVar("T")

UNKNOWN_IDS_PREFIX = "unknown seq_ids "


def unknown_ids_details(seq_ids: Sequence[str]) -> str:
    return (
        f"{UNKNOWN_IDS_PREFIX}{json.dumps(list(seq_ids))}: never started, ended or evicted; "
        "re-send them with is_start=true and the full context"
    )


def parse_unknown_ids(details: str) -> list[str]:
    """Inverse of `unknown_ids_details`; [] if `details` does not have that form."""
    if not details.startswith(UNKNOWN_IDS_PREFIX):
        return []
    try:
        ids, _ = json.JSONDecoder().raw_decode(details, len(UNKNOWN_IDS_PREFIX))
    except json.JSONDecodeError:
        return []
    return [str(seq_id) for seq_id in ids] if isinstance(ids, list) else []


# (exception type, status) in match order: subclasses before their bases.
ErrorTable = Sequence[tuple[type[BaseException], grpc.StatusCode]]
DRAFTING_ERRORS: ErrorTable = (
    (SequenceNotFound, grpc.StatusCode.NOT_FOUND),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def call_or_abort(context: grpc.ServicerContext, rpc: str, fn: Callable[[], T], service: str,
                  extra: ErrorTable = ()) -> T:
    """Runs fn; an error in `extra` or DRAFTING_ERRORS aborts the call with its status (NOT_FOUND
    with the unknown ids in the documented form), anything else is logged and INTERNAL."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - every error becomes a status
        code = next((c for kind, c in (*extra, *DRAFTING_ERRORS) if isinstance(err, kind)), None)
        if code is None:
            logging.getLogger(f"sssd.{service}").exception("%s failed", rpc)
            code, details = grpc.StatusCode.INTERNAL, f"{rpc} failed inside the {service} (logged)"
        elif isinstance(err, SequenceNotFound):
            details = unknown_ids_details(err.seq_ids)
        else:
            details = str(err)
    context.abort(code, details)  # raises
    raise AssertionError("unreachable")


def python_error(err: grpc.RpcError, service: str, target: str, timeout_s: float,
                 extra: Sequence[tuple[grpc.StatusCode, Callable[[str], Exception]]] = ()
                 ) -> Exception:
    """The exception a client raises for a failed call: the drafting errors as the in-process
    object raises them, TimeoutError (deadline), ConnectionError (unreachable), else
    RuntimeError; `extra` maps a service's own status codes."""
    code: grpc.StatusCode = err.code()  # type: ignore[attr-defined]
    details: str = err.details() or ""  # type: ignore[attr-defined]
    for extra_code, make in extra:
        if code == extra_code:
            return make(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return SequenceNotFound(parse_unknown_ids(details))
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return CapacityError(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(f"{service} at {target}: no answer in {timeout_s} s")
    if code == grpc.StatusCode.UNAVAILABLE:
        return ConnectionError(f"{service} at {target} unavailable: {details}")
    return RuntimeError(f"{service} at {target}: {code.name}: {details}")


def unary(method: Any, message: Any, service: str, target: str, timeout_s: float,
          extra: Sequence[tuple[grpc.StatusCode, Callable[[str], Exception]]] = ()) -> Any:
    """One unary call with a deadline; a failure raises `python_error`'s exception."""
    try:
        return method(message, timeout=timeout_s)
    except grpc.RpcError as err:
        raise python_error(err, service, target, timeout_s, extra) from err
