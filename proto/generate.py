"""Regenerates autodist/proto/*_pb2.py from proto/*.proto.

Usage: python proto/generate.py [--check]

Needs grpcio-tools (installed by the ``dev`` and ``test`` extras). The
generated files are committed so that a plain install needs no compiler;
``--check`` exits non-zero when they are out of date.
"""
from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "autodist" / "proto"
# Every (message, field) -> number ever released; tests/test_proto.py checks
# that a number is never given to another field. Append-only.
LOCK = PROTO_DIR / "field_numbers.lock.json"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Runs protoc on every .proto file, writing modules into out_dir."""
    from grpc_tools import protoc  # pylint: disable=import-outside-toplevel

    protos = sorted(PROTO_DIR.glob("*.proto"))
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}"]
    args += [str(p) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return [out_dir / (p.stem + "_pb2.py") for p in protos]


def current_fields() -> dict[str, dict[str, int]]:
    """{message full name: {field name: number}} of the generated modules."""
    sys.path.insert(0, str(ROOT))
    import importlib  # pylint: disable=import-outside-toplevel

    fields: dict[str, dict[str, int]] = {}
    for proto in sorted(PROTO_DIR.glob("*.proto")):
        module = importlib.import_module(f"autodist.proto.{proto.stem}_pb2")
        stack = list(module.DESCRIPTOR.message_types_by_name.values())
        while stack:
            message = stack.pop()
            fields[message.full_name] = {f.name: f.number for f in message.fields}
            stack.extend(message.nested_types)
    return fields


def update_lock() -> None:
    """Adds new fields to the lock file; never removes an entry."""
    import json  # pylint: disable=import-outside-toplevel

    lock = json.loads(LOCK.read_text()) if LOCK.exists() else {}
    for message, fields in current_fields().items():
        lock.setdefault(message, {}).update(
            {name: number for name, number in fields.items()
             if name not in lock.get(message, {})})
    LOCK.write_text(json.dumps(lock, indent=1, sort_keys=True) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="only compare with the committed files")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(pathlib.Path(tmp))
        stale = []
        for path in generated:
            target = OUT_DIR / path.name
            if not target.exists() or target.read_bytes() != path.read_bytes():
                stale.append(target.name)
                if not args.check:
                    shutil.copy(path, target)
    if not args.check:
        update_lock()
    if args.check and stale:
        print("out of date: " + ", ".join(stale), file=sys.stderr)
        return 1
    print("up to date" if not stale else "regenerated: " + ", ".join(stale))
    return 0


if __name__ == "__main__":
    sys.exit(main())
