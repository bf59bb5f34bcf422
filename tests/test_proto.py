"""The committed generated protobuf modules match proto/*.proto."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_is_current():
    pytest.importorskip("grpc_tools")
    result = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_field_numbers_never_reused():
    """A released field number keeps its field, or stays reserved once removed.

    proto/field_numbers.lock.json lists every field ever released; a field
    removed from a message must have its number in `reserved`, and no new
    field may take a number (or a name) the lock gives to another.
    """
    import json

    from google.protobuf import descriptor_pb2

    from autodist.proto import graph_item_pb2, resource_spec_pb2, strategy_pb2

    lock = json.loads((ROOT / "proto" / "field_numbers.lock.json").read_text())
    messages = {}
    for module in (graph_item_pb2, resource_spec_pb2, strategy_pb2):
        file_proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(file_proto)
        stack = [(f"{file_proto.package}.{m.name}", m) for m in file_proto.message_type]
        while stack:
            name, message = stack.pop()
            messages[name] = message
            stack += [(f"{name}.{n.name}", n) for n in message.nested_type]
    for message_name, locked in lock.items():
        assert message_name in messages, f"message {message_name} was removed"
        message = messages[message_name]
        current = {f.name: f.number for f in message.field}
        reserved = {n for r in message.reserved_range for n in range(r.start, r.end)}
        for field, number in locked.items():
            if field in current:
                assert current[field] == number, f"{message_name}.{field} changed number"
            else:
                assert number in reserved, \
                    f"{message_name}.{field} removed without reserving {number}"
        by_number = {n: f for f, n in locked.items()}
        for field, number in current.items():
            assert by_number.get(number, field) == field, \
                f"{message_name}.{field} reuses number {number} of {by_number[number]}"
