"""The daemon's domain errors. Services raise them with a message that says what
was wrong (and the field, for a bad argument); the adapters at the edge turn them
into gRPC status codes (duckd.server) or HTTP statuses and OpenAI's error JSON
(duckd.http_api). Nothing inside the services knows either protocol."""
from __future__ import annotations


class ServiceError(Exception):
    """Base: something the caller should be told."""


class InvalidArgument(ServiceError):
    """A request field is wrong; .field names it (dotted, as the request spells it)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class NotFound(ServiceError):
    """What the request names does not exist (a duck id, a model)."""


class FailedPrecondition(ServiceError):
    """The request is well-formed but the system is not in a state to do it."""


class Unavailable(ServiceError):
    """Not now: starting, a duck not serving, the fleet failed mid-request. Retry later."""


class TooLarge(ServiceError):
    """The request is larger than the daemon takes (daemon.max_request_mb): HTTP 413; gRPC's own
    limit answers RESOURCE_EXHAUSTED."""


class Busy(ServiceError):
    """The queue is full: retry later (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""
