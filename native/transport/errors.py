"""Errors of the host transport."""
from __future__ import annotations


class DuckError(RuntimeError):
    """A duck failed a request; .duck is its index in the fleet, .status its wire status (0 if none)."""

    def __init__(self, message: str, duck: int | None = None, status: int = 0):
        super().__init__(message)
        self.duck, self.status = duck, status


class DuckTimeout(DuckError):
    """A duck did not answer within the failure deadline."""


class ClosedError(RuntimeError):
    """A call on a Fleet after close() (another thread may close one under a caller: a duck's
    health probe replaced at its restart)."""
