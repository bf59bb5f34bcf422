"""Errors raised by the IR layer. Each names what was wrong and what was received."""
from __future__ import annotations


class AutodistError(Exception):
    """Base class of every error autodist raises on purpose."""


class ResourceSpecError(AutodistError, ValueError):
    """A resource spec (cluster description) is malformed."""


class StrategyError(AutodistError, ValueError):
    """A strategy does not fit its GraphItem or ResourceSpec.

    Attributes:
        variable: The variable the error is about ("" for graph-level errors).
        field: The strategy field that is wrong, e.g. "partitioner.num_shards".
        received: The value that was received.
    """

    def __init__(self, message: str, *, variable: str = "", field: str = "",
                 received: object = None) -> None:
        super().__init__(message)
        self.variable = variable
        self.field = field
        self.received = received


class CaptureError(AutodistError, ValueError):
    """A model or step cannot be captured into a GraphItem."""
