"""Parameter-server synchronizer.

Synchronous (``sync=True``): every replica pushes its scaled gradient of a
shard into a conditional accumulator on the shard's PS; the chief takes the
sum once all replicas have pushed, applies one update there, and then hands
each other worker task a token on its own queue. A worker starts its next
step only with a token, so all replicas read the same variables each step.

Asynchronous (``sync=False``): each replica applies its own gradient to the
PS variable as soon as it has it.
"""
from __future__ import annotations

import tensorflow as tf

from autodist.kernels.program import Shard

SCOPE = "autodist/ps"


def accumulator(shard: Shard, purpose: str = "gradient", version: int = 0):
    """The shard's accumulator on its PS, shared by name across tasks.

    Args:
        shard: The shard.
        purpose: "gradient", or "square" for the sum of squared sparse rows.
        version: Membership version of an elastic job: each version has its
            own accumulators, so a partial sum left by a lost worker is
            never taken.
    """
    dtype = tf.as_dtype(shard.dtype)
    with tf.device(shard.synchronizer.ps.reduction_destination):
        name = f"{SCOPE}/accumulator/{purpose}/{shard.name}" + (f"/v{version}" if version else "")
        if shard.sparse:
            return tf.compat.v1.SparseConditionalAccumulator(
                dtype, shape=shard.shape, shared_name=name, name=name.replace("/", "_"),
                reduction_type="SUM")
        return tf.compat.v1.ConditionalAccumulator(
            dtype, shape=shard.shape, shared_name=name, name=name.replace("/", "_"),
            reduction_type="SUM")


def push(acc, shard: Shard, grad, step) -> tf.Operation:
    """Adds one replica's gradient for `step` to the accumulator."""
    if shard.sparse:
        return acc.apply_indexed_slices_grad(grad, local_step=step)
    return acc.apply_grad(grad, local_step=step)


def take(acc, shard: Shard, num_replicas: int | tf.Tensor):
    """The sum of `num_replicas` gradients (blocks until they are all in)."""
    if shard.sparse:
        return acc.take_indexed_slices_grad(num_replicas)
    return acc.take_grad(num_replicas)


def token_queue(device: str, task_index: int, capacity: int = 4,
                version: int = 0) -> tf.queue.FIFOQueue:
    """The queue through which the chief releases worker task `task_index`."""
    with tf.device(device):
        name = f"{SCOPE}/token_queue/task_{task_index}" + (f"/v{version}" if version else "")
        return tf.queue.FIFOQueue(capacity, [tf.int64], shapes=[[]], shared_name=name,
                                  name=name.replace("/", "_"))
