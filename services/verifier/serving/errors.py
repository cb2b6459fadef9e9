"""Why a request was refused or ended early: one kind per gRPC status the frontend answers.

Backends raise `ServingError`s when they refuse a request and put a `StreamError` on the stream
when one fails later; the frontend maps the kind to a status code in one table
(frontend.STATUS_OF_KIND). Nothing matches error text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"  # the request asks for something not allowed
    OVERLOADED = "overloaded"  # the server holds its maximum of requests
    DRAINING = "draining"  # the server is shutting down and admits nothing new
    STOPPED = "stopped"  # the server stopped while the request ran
    INTERNAL = "internal"  # an engine or worker failure


class ServingError(Exception):
    """A refused request."""

    kind = ErrorKind.INTERNAL

    def __init__(self, message: str, kind: ErrorKind | None = None) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = kind


class Overloaded(ServingError):
    kind = ErrorKind.OVERLOADED


class Draining(ServingError):
    kind = ErrorKind.DRAINING


@dataclass(frozen=True)
class StreamError:
    """The last event of a request that failed after it was admitted."""

    kind: ErrorKind
    message: str
