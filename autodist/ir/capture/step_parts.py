"""A captured step run on a whole batch and on two unequal parts of it: what a
distributed run adds up must add up.

Replicas each run the step on their part of the global batch; the run weighs
their gradients by their shares of the examples and sums their metrics'
contributions. That is one device's step when the loss is a mean over examples
and the metrics count examples (or, through `BATCH_PART_INPUT`, parts of a
batch). A step that couples the batch's examples (a contrastive loss, a batch
statistic outside batch normalization), reduces by a sum, or fixes a shape to
the batch size does not add up: found here on random examples, with the
random draws fixed, and refused.
"""
from __future__ import annotations

import numpy as np

from autodist.ir.capture.example_runs import (model_variable_handles, random_examples,
                                              run_batches, without_batch_statistics)
from autodist.ir.errors import CaptureError
from autodist.ir.graph_item import BATCH_PART_INPUT, GraphItem

# The whole batch and where it is cut: unequal parts, as a short last batch gives.
_WHOLE, _CUT = 7, 3
# How far the parts may be from the whole (float32 sums in another order).
_RTOL = 1e-4


def check_parts_add_up(item: GraphItem, model, label: str) -> None:
    """Refuses a step whose gradients or metric contributions on two parts of a batch do
    not add up to the whole batch's.

    Batch normalizations normalize each example on its own here (batch mean 0,
    variance 1, no gradient through them): the run's global-batch rewrite makes
    their batch statistics add up, which this run does not apply. Not checked
    where a masked loss normalizes by the batch's count (also rewritten by the
    run), or where a batch normalization's moments or their gradients are not
    found (not syncable).

    Raises:
        CaptureError: naming the variable or metric that does not add up, or the
            step failing on part of a batch.
    """
    if not parts_checked(item):
        return
    dense = [(v.name, v.gradient.dense) for v in item.variables if v.gradient.dense]
    metrics = [(m.name, m.tensor) for m in item.metric_states]
    named = [(f"the gradient of {n!r}", t) for n, t in dense] + \
        [(f"metric state {n!r}", t) for n, t in metrics]
    graph_def = without_batch_statistics(item.graph_def(), item.batch_norms)
    has_part = any(node.name == BATCH_PART_INPUT for node in graph_def.node)
    state = [(v, np.array(v.numpy())) for v in model.variables if not v.trainable]
    try:
        # Normal values first; where the step's values are not finite on them, values
        # in [0, 1) (a step finite on its real data may not be on normal values).
        for unit in (False, True):
            runs = _run_parts(item, model, graph_def, has_part, named, unit)
            if all(np.all(np.isfinite(v)) for v in runs[0][1]):
                break
        else:
            return   # not finite on either: nothing can be told
    except Exception as e:  # whatever the user's step raises
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CaptureError(
            f"{label} fails on batches of {_WHOLE}, {_CUT} and {_WHOLE - _CUT} examples "
            f"({type(e).__name__}: {first[:300]}), as replicas running parts of the global "
            "batch would: a shape fixed to the batch size? Take the batch size from the "
            "data (keras.ops.shape(x)[0]), or train with Keras' fit on one device") from e
    finally:
        for variable, value in state:
            variable.assign(value)
    _compare(named, runs, dense, label)


def parts_checked(item: GraphItem) -> bool:
    """Whether `check_parts_add_up` checks the step: not with a masked loss, nor with a
    batch normalization whose moments or their gradients were not found."""
    return not item.loss_masks and all(bn.syncable for bn in item.batch_norms)


def _run_parts(item: GraphItem, model, graph_def, has_part: bool, named, unit: bool) -> list:
    """The step's `named` tensors on a random batch and on its two parts, with each
    part's share of the examples."""
    whole = random_examples(item, _WHOLE, seed=1, unit=unit)
    batches, shares = [], []
    for rows in (slice(0, _WHOLE), slice(0, _CUT), slice(_CUT, _WHOLE)):
        batch = {name: value[rows] for name, value in whole.items()}
        shares.append((rows.stop - rows.start) / _WHOLE)
        if has_part:
            batch[f"{BATCH_PART_INPUT}:0"] = np.float32(shares[-1])
        batches.append(batch)
    return list(zip(shares, run_batches(
        graph_def, model_variable_handles(item, model), batches, item.random_ops,
        [t for _, t in named], item.tables)))


def _compare(named, runs, dense, label: str) -> None:
    (_, whole), *parts = runs
    for k, (what, _) in enumerate(named):
        is_gradient = k < len(dense)
        total = sum((share if is_gradient else 1.0) * values[k].astype(np.float64)
                    for share, values in parts)
        expected = whole[k].astype(np.float64)
        scale = float(np.max(np.abs(expected), initial=0.0))
        if np.allclose(total, expected, rtol=_RTOL, atol=_RTOL * scale + 1e-7):
            continue
        how = "their shares of the examples weigh" if is_gradient else "summed"
        raise CaptureError(
            f"{label}: {what} on a batch of {_WHOLE} examples is not that of two parts of "
            f"{_CUT} and {_WHOLE - _CUT} examples, {how} (largest difference "
            f"{float(np.max(np.abs(total - expected))):.3g}, values up to {scale:.3g}), as "
            "a distributed run adds them up. The step couples the batch's examples (a "
            "contrastive loss, a statistic of the batch), reduces by a sum, or tracks a "
            "value that is not a mean over examples (Keras 3's `compiled_metrics."
            "update_state(y, y_pred)` feeds y_pred to every metric of `self.metrics`, its "
            "`Mean` loss trackers too: update those with their loss values alone). "
            "Replicas each running part of the batch cannot reproduce it: train with "
            "Keras' fit on one device")
