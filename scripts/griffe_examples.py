"""A griffe extension (mkdocs.yml, mkdocstrings `extensions:`) for the API reference.

autodist's docstrings head their doctest examples with "Example:", which Google
style (and so griffe) reads as an admonition of Markdown, where `>>>` lines are nested
quotes and an output line such as `['a', 'b']` a reference link. The reference reads
it as the "Examples:" section it is meant to be: rendered as Python console code.
"""
from __future__ import annotations

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Turns "Example:" section headers into "Examples:" in every docstring."""

    def on_object(self, *, obj, **kwargs) -> None:
        docstring = obj.docstring
        if docstring is not None and "Example:" in docstring.value:
            docstring.value = _EXAMPLE.sub(r"\1Examples:", docstring.value)
