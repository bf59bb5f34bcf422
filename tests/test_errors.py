"""Errors autodist raises on purpose are AutodistErrors (issue 17).

A deliberate `raise ValueError(...)` (or RuntimeError, KeyError, TypeError)
in the package would escape `except autodist.AutodistError`. The exceptions
listed in INTERNAL are raised by private parsing helpers whose callers catch
them and raise the module's named error.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

from autodist.ir.errors import AutodistError, InvalidArgumentError, UnknownVariableError
from autodist.search import builders

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "autodist"
BUILTIN = {"ValueError", "RuntimeError", "KeyError", "TypeError", "Exception", "IndexError"}
# file -> functions whose builtin raises their callers turn into named errors.
INTERNAL = {
    "runtime/records.py": {"_int", "_float", "_finite", "_bool", "_str", "convert", "_numbers",
                           "_states", "_segment", "_members", "_probes", "_shape",
                           "_rate_change", "_state_values", "_state_change"},
    "search/database.py": {"_reject_constant"},
    "search/cost_model.py": {"_reject_constant"},
}


def _builtin_raises() -> list[str]:
    found = []

    def visit(node: ast.AST, rel: str, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Raise) and node.exc is not None:
            call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(call, ast.Name) and call.id in BUILTIN and \
                    function not in INTERNAL.get(rel, ()):
                found.append(f"{rel}:{node.lineno} in {function}: raise {call.id}")
        for child in ast.iter_child_nodes(node):
            visit(child, rel, function)

    for path in sorted(PACKAGE.rglob("*.py")):
        if not path.name.endswith("_pb2.py"):
            visit(ast.parse(path.read_text()), path.relative_to(PACKAGE).as_posix(), "<module>")
    return found


def test_deliberate_errors_are_autodist_errors():
    assert _builtin_raises() == []


def test_the_named_errors_stay_catchable_as_builtins():
    assert issubclass(InvalidArgumentError, (AutodistError, ValueError))
    assert issubclass(UnknownVariableError, KeyError)
    # KeyError's str() quotes its argument; the named error reads as its message.
    assert str(UnknownVariableError("no variable 'w'")) == "no variable 'w'"
    with pytest.raises(AutodistError, match="unknown builder 'nope'"):
        builders.get("nope")
