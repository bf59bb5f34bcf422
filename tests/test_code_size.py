"""The package stays in pieces a reader can hold: no class over 450 lines, no function
over 100, no function of more than 20 parameters (issue "architecture step").

Lines are counted without docstrings: documentation is not size (`DistributedRun.fit`
documents each of its ~30 options). The CLI's parser, one flat list of flags, is exempt.
"""
import ast
import pathlib

import autodist

PACKAGE = pathlib.Path(autodist.__file__).parent
MAX_CLASS_LINES, MAX_FUNCTION_LINES, MAX_PARAMETERS = 450, 100, 20
EXEMPT = {("cli.py", "build_parser")}


def _docstring_lines(node: ast.AST) -> int:
    """Lines of the docstrings of `node` and of everything defined inside it."""
    lines = 0
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                inner.body and isinstance(inner.body[0], ast.Expr) and \
                isinstance(inner.body[0].value, ast.Constant) and \
                isinstance(inner.body[0].value.value, str):
            lines += inner.body[0].end_lineno - inner.body[0].lineno + 1
    return lines


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return len([n for n in names if n not in ("self", "cls")])


def _oversized() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "proto" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if (path.name, node.name) in EXEMPT:
                continue
            where = f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"
            lines = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            if lines > limit:
                found.append(f"{where}: {lines} lines (at most {limit})")
            if not isinstance(node, ast.ClassDef) and _parameters(node) > MAX_PARAMETERS:
                found.append(f"{where}: {_parameters(node)} parameters "
                             f"(at most {MAX_PARAMETERS})")
    return found


def test_no_class_function_or_signature_is_oversized():
    assert _oversized() == []
