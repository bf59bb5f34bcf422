"""Keras' `jit_compile=True`: the workers' steps are marked for XLA (no cluster).

Every op of the imported step but its placeholders, collectives and variable
reads and writes carries `_XlaCompile` in a scope of its virtual node, so
TensorFlow clusters what XLA can compile (on CPUs too) and leaves the rest
(lookups, string ops) outside.
"""
from __future__ import annotations

import re

import keras
import autodist
from autodist.ir.capture import capture
from autodist.kernels import partitioner, replicator
from autodist.kernels.program import Program
from autodist.search import builders


def _model(jit: bool):
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(3)(inputs)))
    model.compile("sgd", "mse", jit_compile=jit)
    return model


def _imported(item):
    spec = autodist.ResourceSpec.local(workers=2)
    strategy = builders.AllReduce().build(item, spec).with_virtual_nodes(8, 4)
    program = Program(item, spec, ("worker", 0))
    partitioner.apply(program, strategy)
    replicator.apply(program, strategy)
    return [op for op in program.graph.get_operations() if re.search(r"/vn_\d+/", op.name)]


def _kept_out(op_type: str) -> bool:
    """Inputs, collectives and variable reads and writes stay outside XLA clusters."""
    return op_type == "Placeholder" or op_type.startswith("Collective") or \
        "Variable" in op_type or "Resource" in op_type


def test_a_jit_compiled_models_step_is_marked_for_xla_by_virtual_node():
    item = capture(_model(True))
    assert item.jit_compile
    ops = [op for op in _imported(item) if not _kept_out(op.type)]
    assert ops
    scopes = {op.get_attr("_XlaScope").decode() for op in ops}
    assert all(op.get_attr("_XlaCompile") for op in ops)
    assert scopes == {"autodist_jit_0_0", "autodist_jit_0_1"}


def test_without_jit_compile_nothing_is_marked():
    item = capture(_model(False))
    assert not item.jit_compile
    assert not any("_XlaCompile" in op.node_def.attr for op in _imported(item))
