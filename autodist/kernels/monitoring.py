"""Monitoring ops: the gradient-noise-scale statistics of a step, in the graph.

The gradient noise scale B_noise = tr(Σ) / |G|² (Σ the per-example gradient
covariance, G the true gradient) is the batch size beyond which a larger
batch stops paying off. For a mean-loss gradient over b examples,
E|g_b|² = |G|² + tr(Σ) / b, so two batch sizes give unbiased estimates of
both terms (`noise_scale`).

A replica with several virtual nodes has both sizes for free: each virtual
node's gradient (b = its examples) and the replica's accumulated gradient
(b = the replica's examples). `gradient_sq_norms` adds only local reductions
to the step; no extra communication. `step_timestamps` splits a task's step
into its local compute and the rest (communication, waiting, update).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import tensorflow as tf

from autodist.ir.errors import InvalidArgumentError
from autodist.kernels.program import Replica


def sq_norm(gradients) -> tf.Tensor:
    """Σ over variables of the squared L2 norm (float32); IndexedSlices densified.

    Repeated rows of a sparse gradient are summed first, as the dense
    gradient would hold them.
    """
    terms = []
    for grad in gradients:
        if isinstance(grad, tf.IndexedSlices):
            unique, position = tf.unique(grad.indices)
            rows = tf.math.unsorted_segment_sum(grad.values, position, tf.size(unique))
            terms.append(tf.reduce_sum(tf.square(tf.cast(rows, tf.float32))))
        else:
            terms.append(tf.reduce_sum(tf.square(tf.cast(grad, tf.float32))))
    return tf.add_n(terms) if terms else tf.constant(0.0)


def gradient_sq_norms(replica: Replica) -> dict[str, tf.Tensor]:
    """The replica's inputs to the noise-scale estimators.

    Returns:
        {"virtual_nodes": [|g_v|² of each virtual node], "replica": |g|² of
        the replica's accumulated gradient}, float32 scalars on the
        replica's device. With one virtual node both are the same gradient.
    """
    with tf.device(replica.device):
        return {"virtual_nodes": tf.stack([_mean_loss_sq_norm(vn)
                                           for vn in replica.virtual_nodes]),
                "replica": sq_norm(replica.gradients.values())}


def _mean_loss_sq_norm(vn) -> tf.Tensor:
    """|g|² of the gradient of `vn`'s mean loss (its weighted gradient / weight)."""
    norm = sq_norm(vn.gradients.values())
    if not vn.weighted:
        return norm
    # A virtual node with no examples has weight 0 and gradient 0.
    return tf.math.divide_no_nan(norm, tf.square(tf.cast(vn.weight, tf.float32)))


def step_timestamps(replicas: Sequence[Replica], train_op: tf.Operation) -> dict[str, tf.Tensor]:
    """Wall-clock marks inside one task's step: the compute / communication split.

    Returns:
        {"start": a float64 placeholder the caller feeds with the host's
        wall clock (`time.time()`) just before the run, "gradients": once
        every local replica's accumulated gradient is computed, "end": after
        `train_op` (synchronization and update)}, float64 seconds since the
        epoch. The local compute is gradients - start (it includes handing
        the feed to the session), the rest of the step (waiting for the
        others, communication, the update) end - gradients. Only local ops:
        fetched with the step, they add no synchronization.

    Why fed: a `tf.timestamp()` with no inputs is not ordered before the
    forward pass; the executor may run it after the gradients (measured on
    a small MLP: 4% of steps on 2 busy cores), and such a step has no
    compute time.
    """
    with tf.device(replicas[0].device), tf.control_dependencies(None):
        start = tf.compat.v1.placeholder(tf.float64, [], name="autodist_step_start")
        done = [g.values if isinstance(g, tf.IndexedSlices) else g
                for r in replicas for g in r.gradients.values()]
        with tf.control_dependencies(done):
            gradients = tf.timestamp()
        with tf.control_dependencies([train_op, gradients]):  # not before "gradients"
            end = tf.timestamp()
    return {"start": start, "gradients": gradients, "end": end}


@dataclasses.dataclass(frozen=True)
class NoiseScale:
    """Estimates from one step (or smoothed over steps).

    Attributes:
        gradient_sq: |G|², the squared norm of the true gradient.
        trace_sigma: tr(Σ), the per-example gradient variance.
        noise_scale: B_noise = tr(Σ) / |G|² (inf when |G|² <= 0).
    """

    gradient_sq: float
    trace_sigma: float
    noise_scale: float


def noise_scale(small_sq: float, small_batch: float, big_sq: float,
                big_batch: float) -> NoiseScale:
    """Unbiased |G|² and tr(Σ) from squared gradient norms at two batch sizes.

    Args:
        small_sq: Mean |g|² of gradients over `small_batch` examples.
        small_batch: The smaller batch size.
        big_sq: Mean |g|² of gradients over `big_batch` examples.
        big_batch: The larger batch size (> small_batch).

    Raises:
        ValueError: big_batch <= small_batch, or a batch size < 1.
    """
    if small_batch < 1 or big_batch <= small_batch:
        raise InvalidArgumentError("noise_scale needs 1 <= small_batch < big_batch. Received: "
                                   f"small_batch={small_batch}, big_batch={big_batch}")
    gradient_sq = (big_batch * big_sq - small_batch * small_sq) / (big_batch - small_batch)
    trace_sigma = (small_sq - big_sq) / (1.0 / small_batch - 1.0 / big_batch)
    scale = trace_sigma / gradient_sq if gradient_sq > 0 else float("inf")
    return NoiseScale(float(gradient_sq), float(trace_sigma), float(scale))


def noise_scale_fit(batches, sq_norms) -> NoiseScale | None:
    """|G|² and tr(Σ) by least squares on |g_b|² = |G|² + tr(Σ) / b.

    Takes any number of (batch size, squared norm) measurements, e.g. every
    virtual node's and every replica's of one step, whatever their sizes;
    with two distinct sizes and equal counts it is `noise_scale` on the
    means.

    Returns:
        The estimates, or None with fewer than two distinct batch sizes.
    """
    x = [1.0 / float(b) for b in batches]
    y = [float(v) for v in sq_norms]
    if len(set(x)) < 2:
        return None
    n = len(x)
    mean_x, mean_y = sum(x) / n, sum(y) / n
    slope = (sum((a - mean_x) * (b - mean_y) for a, b in zip(x, y))
             / sum((a - mean_x) ** 2 for a in x))
    gradient_sq = mean_y - slope * mean_x
    scale = slope / gradient_sq if gradient_sq > 0 else float("inf")
    return NoiseScale(float(gradient_sq), float(slope), float(scale))


class SmoothedNoiseScale:
    """Exponential moving averages of |G|² and tr(Σ), their ratio the noise scale.

    The two terms are averaged separately (their ratio is biased per step),
    as in the gradient-noise-scale literature.

    Args:
        decay: Weight of the history, in [0, 1).
    """

    def __init__(self, decay: float = 0.9) -> None:
        if not 0 <= decay < 1:
            raise InvalidArgumentError(f"decay must be in [0, 1). Received: {decay}")
        self.decay = decay
        self._gradient_sq: float | None = None
        self._trace_sigma: float | None = None

    def update(self, step: NoiseScale) -> NoiseScale:
        """Adds one step's estimates; returns the smoothed ones."""
        if self._gradient_sq is None:
            self._gradient_sq, self._trace_sigma = step.gradient_sq, step.trace_sigma
        else:
            d = self.decay
            self._gradient_sq = d * self._gradient_sq + (1 - d) * step.gradient_sq
            self._trace_sigma = d * self._trace_sigma + (1 - d) * step.trace_sigma
        scale = self._trace_sigma / self._gradient_sq if self._gradient_sq > 0 else float("inf")
        return NoiseScale(self._gradient_sq, self._trace_sigma, scale)
