"""The gRPC plumbing the internal services share: one error <-> status table for both ends.

The drafter and the speculator expose the same drafting errors (sssd.common.drafting) and map
them the same way: a servicer runs the core's call under `call_or_abort`, and a client turns the
status back with `python_error`, so each end raises what the in-process object would. A service
adds its own rows (`extra`) for errors only it has.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from sssd.common.drafting import CapacityError, SequenceNotFound
from sssd.common.status import parse_unknown_ids, unknown_ids_details

T = TypeVar("T")

# (exception type, status) in match order: subclasses before their bases.
ErrorTable = Sequence[tuple[type[BaseException], grpc.StatusCode]]
DRAFTING_ERRORS: ErrorTable = (
    (SequenceNotFound, grpc.StatusCode.NOT_FOUND),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)

# A neighbour on the same node or rack: after it restarts, reconnect within a second (gRPC's
# default backoff grows to two minutes, all of them without speculation). Starting a batch of
# long prompts may exceed gRPC's default 4 MiB message limit.
CLIENT_CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1),
                          ("grpc.max_receive_message_length", -1),
                          ("grpc.initial_reconnect_backoff_ms", 100),
                          ("grpc.min_reconnect_backoff_ms", 100),
                          ("grpc.max_reconnect_backoff_ms", 1000)]


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


def serve_until_signal(server: grpc.Server, health_servicer: Any, grace_s: float,
                       on_stop: Callable[[], None] | None = None) -> None:
    """Blocks until SIGTERM or SIGINT, then: health NOT_SERVING (for watchers and load
    balancers), `on_stop` in a thread of its own (a service's drain), in-flight calls given
    `grace_s` seconds; a second signal cuts the grace period short. Restores the handlers."""
    is_stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if is_stopping.is_set():
            server.stop(0)
            return
        is_stopping.set()
        logging.getLogger(__name__).info("%s: stopping, grace %.1f s",
                                         signal.Signals(signum).name, grace_s)
        health_servicer.enter_graceful_shutdown()
        if on_stop is not None:
            threading.Thread(target=on_stop, daemon=True).start()
        server.stop(grace_s)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.wait_for_termination()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
