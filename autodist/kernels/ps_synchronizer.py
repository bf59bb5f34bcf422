"""Parameter-server synchronizer.

Synchronous (``sync=True``): every replica pushes its scaled gradient of a
shard into a queue of its own on the shard's PS; the chief takes the sum in
replica order once all replicas have pushed (`OrderedSum`: the same bits on
every rerun, whatever order the gradients arrive in), applies one update there, and then hands
each other worker task a token on its own queue. A worker starts its next
step only with a token, so all replicas read the same variables each step.

Asynchronous (``sync=False``): each replica applies its own gradient to the
PS variable as soon as it has it.
"""
from __future__ import annotations

import tensorflow as tf

from autodist.kernels.program import Shard

SCOPE = "autodist/ps"


class OrderedSum:
    """The sum of the replicas' gradients of one shard, in replica order, on its PS.

    Each replica enqueues its gradient into a queue of its own on the shard's
    parameter server (shared by name across tasks); the chief dequeues one
    from each queue in the strategy's replica order and adds them in that
    order. Float addition is not associative, so a sum taken as the
    gradients arrive (a conditional accumulator) differs from run to run in
    the last bits with three or more replicas; this one is the same on every
    rerun. Dense gradients are added (`tf.add_n`, inputs in order); sparse
    ones concatenated in order (their updates add repeated rows in order).

    Args:
        shard: The shard.
        replicas: The indices of the replicas that push a gradient of it.
        purpose: "gradient", or "square" for Keras' squared sparse rows.
        version: Membership version of an elastic job: each version has its
            own queues, so a gradient left by a lost worker is never taken.
    """

    def __init__(self, shard: Shard, replicas, purpose: str = "gradient", version: int = 0):
        self.shard = shard
        self.replicas = list(replicas)
        dtype = tf.as_dtype(shard.dtype)
        dtypes = [dtype, tf.int64] if shard.sparse else [dtype]
        self.queues = {}
        with tf.device(shard.synchronizer.ps.reduction_destination):
            for r in self.replicas:
                name = (f"{SCOPE}/sum/{purpose}/{shard.name}/replica_{r}" +
                        (f"/v{version}" if version else ""))
                # Any shape: a sparse gradient's rows change every step. Two slots: a
                # replica may push the next step before the chief has taken this one.
                self.queues[r] = tf.queue.FIFOQueue(2, dtypes, shared_name=name,
                                                    name=name.replace("/", "_"))

    def push(self, replica: int, grad) -> tf.Operation:
        """Hands in replica `replica`'s gradient (runs on the PS)."""
        if self.shard.sparse:
            return self.queues[replica].enqueue([grad.values, tf.cast(grad.indices, tf.int64)])
        return self.queues[replica].enqueue([grad])

    def take(self):
        """The sum in replica order (blocks until every replica's gradient is in)."""
        with tf.device(self.shard.synchronizer.ps.reduction_destination):
            parts = [self.queues[r].dequeue() for r in self.replicas]
            if self.shard.sparse:
                values = tf.concat([p[0] for p in parts], axis=0)
                indices = tf.concat([p[1] for p in parts], axis=0)
                values = tf.reshape(values, [-1] + list(self.shard.shape[1:]))
                return tf.IndexedSlices(values, indices,
                                        tf.constant(list(self.shard.shape), tf.int64))
            parts = [tf.reshape(p if not isinstance(p, (list, tuple)) else p[0],
                                self.shard.shape) for p in parts]
            return parts[0] if len(parts) == 1 else tf.add_n(parts)


def token_queue(device: str, task_index: int, capacity: int = 4,
                version: int = 0) -> tf.queue.FIFOQueue:
    """The queue through which the chief releases worker task `task_index`."""
    with tf.device(device):
        name = f"{SCOPE}/token_queue/task_{task_index}" + (f"/v{version}" if version else "")
        return tf.queue.FIFOQueue(capacity, [tf.int64], shapes=[[]], shared_name=name,
                                  name=name.replace("/", "_"))
