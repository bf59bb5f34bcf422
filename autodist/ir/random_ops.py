"""Which random ops of a step draw for the batch, and along which axis.

Keras' random layers (Dropout and its spatial, Gaussian and alpha kinds,
GaussianNoise, the random augmentation layers) draw with stateless random
ops seeded from a `SeedGenerator`'s state: a draw is a function of (seed,
shape). One device draws for the whole batch; a replica holding part of the
batch would draw another tensor of its own shape. A stateless draw of the
global batch's shape, sliced to a replica's rows, is exactly the rows one
device draws (the Philox stream depends on the shape, not on where it runs),
so the runtime draws that way (`autodist.kernels.random_draws`) for every op
listed here as reproducible.

An op is found reproducible when exactly one axis of its shape grows with
the batch (the examples, or rows proportional to them such as examples x
timesteps), seen by shape inference at two batch sizes. Ops whose draws a
distributed step cannot match are listed too, with the reason: stateful
random ops (their stream is the kernel's own state on each device), ops
whose shape cannot be inferred, draws shaped by data (`StatelessMultinomial`).
"""
from __future__ import annotations

import re
from typing import Mapping, Sequence

import tensorflow as tf

from autodist.ir.batch_shapes import graphs_at_batches
from autodist.proto import graph_item_pb2

# Stateless ops drawing a tensor of the shape given as input 0.
SHAPED = {"StatelessRandomUniformV2", "StatelessRandomNormalV2", "StatelessTruncatedNormalV2",
           "StatelessRandomUniformIntV2", "StatelessRandomUniformFullIntV2",
           "StatelessRandomUniform", "StatelessRandomNormal", "StatelessTruncatedNormal",
           "StatelessRandomUniformInt", "StatelessRandomUniformFullInt",
           "StatelessRandomBinomial", "StatelessRandomPoisson", "StatelessRandomGammaV2",
           "StatelessRandomGammaV3", "StatelessParameterizedTruncatedNormal"}
# Random ops a distributed step cannot draw as one device does.
_UNREPRODUCIBLE = {
    "RandomUniform": "a stateful random op (its stream is each device's own kernel state)",
    "RandomStandardNormal": "a stateful random op",
    "TruncatedNormal": "a stateful random op", "RandomUniformInt": "a stateful random op",
    "RandomShuffle": "a stateful shuffle", "Multinomial": "a stateful random op",
    "RandomGamma": "a stateful random op", "RandomPoisson": "a stateful random op",
    "RandomPoissonV2": "a stateful random op", "ParameterizedTruncatedNormal":
    "a stateful random op", "StatefulUniform": "a stateful random op",
    "StatefulUniformInt": "a stateful random op", "StatefulUniformFullInt":
    "a stateful random op", "StatefulStandardNormalV2": "a stateful random op",
    "StatefulTruncatedNormal": "a stateful random op",
    "StatelessMultinomial": "a draw whose shape comes from each replica's own data",
    "StatelessShuffle": "a shuffle of each replica's own rows",
}
# The name scopes TensorFlow's and Keras' random functions open around their ops.
_RANDOM_FUNCTION_SCOPE = re.compile(
    r"(stateless_\w+|stateful_\w+|(random|truncated_normal|multinomial|categorical|shuffle|"
    r"parameterized_truncated_normal)\w*)$")
TRIAL_BATCHES = (3, 5)
UNINFERRED = ("its shape could not be inferred from the inputs' shapes (the step did not "
              "import with stand-ins for their unknown dimensions, or the shape depends on "
              "values)")


def analyze(graph_def, inputs,
            handles: Mapping[str, tuple[str, Sequence[int]]] | None = None
            ) -> list[graph_item_pb2.RandomOpInfo]:
    """The random ops of the step, each with its batch axis or why it cannot be matched.

    Args:
        graph_def: The captured step.
        inputs: Its input TensorInfos (their shapes: -1 unknown).
        handles: The placeholder of each variable read by the step -> (dtype,
            shape), so shape inference knows what the reads give.
    """
    candidates = [n for n in graph_def.node if n.op in SHAPED or n.op in _UNREPRODUCIBLE]
    if not candidates:
        return []
    shaped = [n for n in candidates if n.op in SHAPED]
    shapes = _shapes_at_trial_batches(graph_def, inputs, shaped, handles or {})
    out = []
    for node in candidates:
        layer = _layer(node.name)
        if node.op in _UNREPRODUCIBLE:
            out.append(graph_item_pb2.RandomOpInfo(node=node.name, batch_axis=-1, layer=layer,
                                                   reproducible=False,
                                                   reason=_UNREPRODUCIBLE[node.op]))
            continue
        small, large = shapes[0].get(node.name), shapes[1].get(node.name)
        info = graph_item_pb2.RandomOpInfo(node=node.name, shape_input=0, layer=layer)
        if small is None or large is None or len(small) != len(large):
            info.batch_axis, info.reason = -1, UNINFERRED
            out.append(info)
            continue
        if set_batch_axis(info, small, large) is not None:
            out.append(info)
    return out


def set_batch_axis(info, small: Sequence[int], large: Sequence[int]):
    """Sets `info`'s batch axis from its draw's shapes at `TRIAL_BATCHES`; returns it, or
    None for a draw that does not depend on the batch (nothing to do)."""
    info.rank = len(small)
    axes = [a for a, (p, q) in enumerate(zip(small, large)) if p != q]
    if not axes:
        info.batch_axis, info.reproducible, info.reason = -1, True, ""
        return None   # the same draw for any batch: every replica draws what one device does
    b0, b1 = TRIAL_BATCHES
    grows = [a for a in axes if small[a] % b0 == 0 and small[a] // b0 * b1 == large[a]]
    if len(axes) != 1 or len(grows) != 1:
        info.batch_axis, info.reproducible = -1, False
        info.reason = "several dimensions of its shape follow the batch"
        return info
    info.batch_axis, info.reproducible, info.reason = grows[0], True, ""
    return info


def _shapes_at_trial_batches(graph_def, inputs, nodes,
                             handles: Mapping[str, tuple[str, Sequence[int]]]
                             ) -> list[dict[str, list[int] | None]]:
    """The shape each node draws at each of `TRIAL_BATCHES` (empty where the step did not
    import), with the first stand-in length at which it imports at both."""
    imported = graphs_at_batches(graph_def, inputs, TRIAL_BATCHES, handles)
    if imported is None:
        return [{} for _ in TRIAL_BATCHES]
    return [_shapes_in(g, nodes) for g in imported[1]]


def _shapes_in(graph: tf.Graph, nodes) -> dict[str, list[int] | None]:
    """The shape each node draws in `graph` (None: not inferred)."""
    out = {}
    for node in nodes:
        # The draw's shape as TensorFlow's shape inference reads it from the shape input.
        shape = graph.get_operation_by_name(node.name).outputs[0].shape
        out[node.name] = shape.as_list() if shape.is_fully_defined() else None
    return out


def _layer(node_name: str) -> str:
    """The Keras layer a node belongs to: its name scopes without those TensorFlow's
    random functions open (`random_uniform`, `stateless_random_normal_1`, ...), so a
    layer nested in blocks is named to the innermost one (`model/block_2/drop_path`)."""
    scopes = node_name.split("/")[:-1]
    while len(scopes) > 1 and _RANDOM_FUNCTION_SCOPE.match(scopes[-1]):
        scopes.pop()
    return "/".join(scopes) or node_name
