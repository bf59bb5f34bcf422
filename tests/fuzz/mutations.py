"""Mutations of reader inputs: byte-level damage and extreme field values.

Every mutation is a pure function of a `random.Random`, so a case is
reproduced from its seed and index alone (see `case_rng`).
"""
from __future__ import annotations

import copy
import random
from typing import Any, Callable

# Values a field is set to: wrong sign, out of range, not finite, wrong type, huge.
EXTREME_NUMBERS: tuple[Any, ...] = (
    -1, 0, 1, 2 ** 31 - 1, 2 ** 31, -2 ** 31, 2 ** 32, 2 ** 63, -2 ** 63, 10 ** 30,
    float("nan"), float("inf"), float("-inf"), -1.0, 1e308, -1e-320, 0.5,
)
EXTREME_VALUES: tuple[Any, ...] = EXTREME_NUMBERS + (
    None, True, False, "", "x" * 100_000, "\x00", "\udc80", "\u202e",
    [], {}, [1, 2, 3], {"a": 1}, "nan", "../../etc/passwd", "/tmp", 1_000_000_000,
)
# Tokens spliced into text formats.
TOKENS: tuple[bytes, ...] = (
    b"nan", b"NaN", b"inf", b"-inf", b"Infinity", b"-1", b"0", b"2147483648", b"-2147483649",
    b"4294967296", b"9223372036854775808", b"1e308", b"1e999", b"null", b"true", b"~",
    b"[]", b"{}", b'"', b"'", b"\\", b"\\u0000", b"\x00", b"\xff\xfe", b"\n", b":", b",",
    b"&a", b"*a", b"!!python/object:os.system", b"- ", b"  ", b"<<: *a",
    b"9" * 400, b"A" * 20_000, b"[" * 5000, b"{" * 5000, b"-" * 3000,
)


def case_rng(target: str, seed: int, index: int) -> random.Random:
    """The random source of one case (string seeding is stable across runs)."""
    return random.Random(f"{target}:{seed}:{index}")


def deep_list(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def deep_dict(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = {"a": value}
    return value


def extreme_value(rng: random.Random) -> Any:
    """A value of the wrong kind or out of range, sometimes deeply nested."""
    roll = rng.random()
    # Nesting deeper than a dumper can write is spliced into the text instead
    # (see targets._splice_deep).
    if roll < 0.05:
        return deep_list(rng.choice((10, 50, 200)))
    if roll < 0.08:
        return deep_dict(rng.choice((10, 50, 200)))
    if roll < 0.12:
        return [rng.choice(EXTREME_NUMBERS)] * rng.choice((2, 100, 5000))
    return copy.deepcopy(rng.choice(EXTREME_VALUES))   # later mutations must not alias it


# ------------------------------------------------------------ byte mutations
def _flip(data: bytearray, rng: random.Random) -> None:
    if data:
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)


def _truncate(data: bytearray, rng: random.Random) -> None:
    del data[rng.randrange(len(data) + 1):]


def _insert(data: bytearray, rng: random.Random) -> None:
    at = rng.randrange(len(data) + 1)
    data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))


def _delete(data: bytearray, rng: random.Random) -> None:
    if data:
        at = rng.randrange(len(data))
        del data[at:at + rng.randint(1, 64)]


def _duplicate(data: bytearray, rng: random.Random) -> None:
    if data:
        at = rng.randrange(len(data))
        chunk = data[at:at + rng.randint(1, 256)]
        to = rng.randrange(len(data) + 1)
        data[to:to] = chunk * rng.choice((1, 2, 50))


def _overwrite(data: bytearray, rng: random.Random) -> None:
    if data:
        at = rng.randrange(len(data))
        value = rng.choice((0x00, 0xFF, 0x7F, 0x80, 0x01))
        for i in range(at, min(len(data), at + rng.randint(1, 8))):
            data[i] = value


def _splice_token(data: bytearray, rng: random.Random) -> None:
    at = rng.randrange(len(data) + 1)
    token = rng.choice(TOKENS)
    if rng.random() < 0.5 and data:   # replace the token-like run at `at`
        end = at
        while end < len(data) and chr(data[end]).isalnum():
            end += 1
        data[at:end] = token
    else:
        data[at:at] = token


BYTE_MUTATIONS: tuple[Callable[[bytearray, random.Random], None], ...] = (
    _flip, _flip, _truncate, _insert, _delete, _duplicate, _overwrite, _splice_token,
)


def mutate_bytes(data: bytes, rng: random.Random, max_ops: int = 3) -> bytes:
    """`data` with 1..max_ops random byte-level mutations."""
    out = bytearray(data)
    for _ in range(rng.randint(1, max_ops)):
        rng.choice(BYTE_MUTATIONS)(out, rng)
    return bytes(out)


def set_random_path(obj: Any, rng: random.Random, value: Any) -> Any:
    """Replaces one randomly chosen node of a JSON-like tree (dicts and lists) by `value`."""
    paths: list[tuple] = []

    def walk(node: Any, path: tuple) -> None:
        paths.append(path)
        if isinstance(node, dict):
            for key, child in node.items():
                walk(child, path + (key,))
        elif isinstance(node, list):
            for i, child in enumerate(node[:20]):
                walk(child, path + (i,))

    walk(obj, ())
    path = rng.choice(paths[1:] or paths)
    if not path:
        return value
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    roll = rng.random()
    if roll < 0.1 and isinstance(parent, dict):
        del parent[path[-1]]
    elif roll < 0.15 and isinstance(parent, dict):
        parent[rng.choice(("unknown", "x" * 300, "", "nodes"))] = value
    else:
        parent[path[-1]] = value
    return obj
