"""Errors raised by the IR layer. Each names what was wrong and what was received.

Messages are bounded: a value echoed into a message goes through `short_repr`
(its cost is bounded too, whatever the value's size or nesting), and an
`AutodistError` message longer than `MAX_MESSAGE_CHARS` is cut in the middle.
"""
from __future__ import annotations

import reprlib

# The longest message an AutodistError keeps; longer ones lose their middle.
MAX_MESSAGE_CHARS = 4000
# The longest `short_repr` of a received value.
MAX_VALUE_CHARS = 200


def short_repr(value: object, limit: int = MAX_VALUE_CHARS) -> str:
    """A repr of `value` of at most `limit` characters, computed in bounded time.

    Containers show their first few items and nesting a few levels deep (the
    rest as "..."), so a huge or deeply nested value — e.g. a YAML alias bomb —
    costs no more than a small one.
    """
    shortener = reprlib.Repr()
    shortener.maxlevel = 3
    shortener.maxtuple = shortener.maxlist = shortener.maxarray = shortener.maxdict = 6
    shortener.maxset = shortener.maxfrozenset = shortener.maxdeque = 6
    shortener.maxstring = shortener.maxother = limit
    shortener.maxlong = 60
    try:
        text = shortener.repr(value)
    except Exception:  # noqa: BLE001  # a broken __repr__ must not hide the error
        text = f"<{type(value).__name__}>"
    return shorten(text, limit)


def shorten(text: str, limit: int) -> str:
    """`text` cut in the middle to at most `limit` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    note = f" ...[{len(text) - limit} chars omitted]... "
    keep = max(limit - len(note), 2)
    return text[:keep // 2] + note + text[len(text) - (keep - keep // 2):]


class AutodistError(Exception):
    """Base class of every error autodist raises on purpose.

    A message longer than `MAX_MESSAGE_CHARS` is cut in the middle.
    """

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str) and len(args[0]) > MAX_MESSAGE_CHARS:
            args = (shorten(args[0], MAX_MESSAGE_CHARS),) + args[1:]
        super().__init__(*args)


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


class InvalidArgumentError(AutodistError, ValueError):
    """An argument or option has a value autodist cannot use.

    The message names the argument and the value received.
    """


class UnknownVariableError(AutodistError, KeyError):
    """A variable name that the GraphItem or strategy does not have."""

    def __str__(self) -> str:
        # KeyError's own str() would quote the message.
        return str(self.args[0]) if self.args else ""


class UnknownArgumentError(AutodistError, TypeError):
    """A keyword argument a function does not take (as Python's own `TypeError`).

    The message names it and the closest argument the function takes.
    """


class UnknownFieldError(AutodistError, KeyError):
    """A field a record does not have (read by key)."""

    def __str__(self) -> str:
        # KeyError's own str() would quote the message.
        return str(self.args[0]) if self.args else ""
