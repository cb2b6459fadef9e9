"""The API key of the public APIs (the OpenAI-compatible HTTP API and the gRPC Generate API).

A server started with a key requires it on every request: over HTTP as `Authorization: Bearer
<key>` (what the `openai` SDK sends) on /v1/* and the tokenize endpoints, over gRPC as the same
`authorization` call metadata on the Generation service. The key comes from, first found:

    --api-key KEY           (a flag shows in `ps`: prefer one of the next two)
    --api-key-file PATH     a file holding it (a mounted Secret); SSSD_API_KEY_FILE
    SSSD_API_KEY            the key itself

Keys are compared in constant time (of their SHA-256 digests, so not even their length leaks).
Without a key the APIs stay open, which `sssd up` allows only on a loopback `--host`.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os

import grpc

from sssd.common.config.secrets import read_secret_file

KEY_ENV, FILE_ENV = "SSSD_API_KEY", "SSSD_API_KEY_FILE"
METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
BEARER = "Bearer "


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


class ApiKey:
    """One server's key; `matches` compares a presented credential in constant time."""

    def __init__(self, key: str) -> None:
        if not key or key != key.strip() or any(c in key for c in "\r\n"):
            raise ValueError("the API key must be non-empty, without surrounding whitespace "
                             "or line breaks")
        self._digest = _digest(key)

    def matches(self, authorization: str | None) -> bool:
        """True when `authorization` is "Bearer <key>" (the scheme case-insensitive)."""
        if not authorization or authorization[:len(BEARER)].lower() != BEARER.lower():
            return False
        return hmac.compare_digest(_digest(authorization[len(BEARER):].strip()), self._digest)


def resolve_key(key: str | None = None, key_file: str | None = None,
                environ: dict[str, str] | None = None) -> str | None:
    """The configured key (flags first, then SSSD_API_KEY_FILE, then SSSD_API_KEY), or None."""
    environ = os.environ if environ is None else environ
    if key:
        return key
    key_file = key_file or environ.get(FILE_ENV)
    if key_file:
        return read_secret_file(key_file, "--api-key-file")
    return environ.get(KEY_ENV) or None


def add_api_key_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(f"API key (defaults from {FILE_ENV} or {KEY_ENV})")
    group.add_argument("--api-key", default=None,
                       help="require this bearer token on the HTTP /v1 and tokenize endpoints "
                       "and as gRPC `authorization` metadata (unset: open, loopback only for "
                       "sssd up)")
    group.add_argument("--api-key-file", default=None, help="read the API key from this file")


def api_key_from_args(args: argparse.Namespace) -> str | None:
    """The key of the flags or the environment, exported as SSSD_API_KEY so that the clients
    this process starts (the `sssd up` check) present it."""
    key = resolve_key(args.api_key, args.api_key_file)
    if key is not None:
        ApiKey(key)  # a malformed key fails at start, not at the first request
        os.environ[KEY_ENV] = key
    return key


def call_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata that presents `key` (none without one)."""
    return ((METADATA_KEY, BEARER + key),) if key else ()


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Refuses calls to the `protected` services (full names) without the key: UNAUTHENTICATED.
    Health checking and reflection stay open, so probes and tools work without the secret."""

    def __init__(self, key: ApiKey, protected: tuple[str, ...]) -> None:
        self.key = key
        self.prefixes = tuple(f"/{name}/" for name in protected)

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong API key: send `authorization: Bearer <key>` "
                          "call metadata")

        self._refusal = grpc.unary_stream_rpc_method_handler(refuse)

    def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(self.prefixes):
            return continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get(METADATA_KEY)
        if self.key.matches(presented):
            return continuation(handler_call_details)
        return self._refusal
