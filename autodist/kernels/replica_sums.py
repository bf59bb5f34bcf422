"""Sums over the replicas of a step, inside its forward and backward pass.

The rewrites that make each replica compute what one device computes on the
global batch (batch statistics, a masked loss's count of unmasked values) add
`CollectiveReduceV2` nodes to the step's GraphDef. They share one collective
group, far from the gradients' (see `all_reduce_synchronizer`), and number
their instances in the order they are added: every replica rewrites the same
step in the same order, so every replica's collectives have the same keys.
A sum whose size the caller knows and `ir.strategy.sums_by_gathering` calls
small (batch statistics: a few values per channel) gathers every replica's
tensor and adds them, one exchange where the ring takes 2 (W-1), as the
all-reduce synchronizer does with small gradient groups.
"""
from __future__ import annotations

import tensorflow as tf

from autodist.ir.strategy import sums_by_gathering
from autodist.kernels import graph_edit

# Far from the gradients' group keys (1 + membership version) and the version
# tags' (1,000,000 + task): their own group, so instance keys never meet.
GROUP_KEY = 2_000_000
# The instance of the synchronizer's end-of-run barrier in that group (the sums
# number theirs from 1).
BARRIER_KEY = 1_000_000
_PREFIX = "autodist_replica_sums"


class ReplicaSums:
    """Adds sum-over-replicas nodes to a GraphDef.

    Args:
        graph_def: The step being rewritten (edited in place).
        group_size: Replicas in the step.
        version: Membership version of an elastic job (a new group each).
        timeout_s: Bound on every collective.
        hint: The communication hint ("ring", or "nccl" on GPUs).
    """

    def __init__(self, graph_def, *, group_size: int, version: int, timeout_s: float,
                 hint: str = "ring") -> None:
        self.graph_def, self.timeout_s, self.hint = graph_def, float(timeout_s), hint
        self.group_size = group_size
        self.size = graph_edit.const(graph_def, f"{_PREFIX}/group_size", group_size, tf.int32)
        self.group = graph_edit.const(graph_def, f"{_PREFIX}/group_key", GROUP_KEY + version,
                                      tf.int32)
        self.count = 0

    def sum(self, name: str, tensor: str, dtype: tf.DType, elements: int | None = None) -> str:
        """Adds the sum over replicas of `tensor` as node `name`; returns its name.

        Args:
            name: The sum's node.
            tensor: What each replica sums.
            dtype: Its dtype.
            elements: Its number of elements where known (the same on every
                replica); small sums are gathered and added.
        """
        self.count += 1
        instance = graph_edit.const(self.graph_def, f"{name}/instance_key", self.count,
                                    tf.int32)
        if self.hint == "ring" and elements is not None and \
                sums_by_gathering(elements * dtype.size, self.group_size, dtype.size):
            axis = graph_edit.const(self.graph_def, f"{name}/axis", 0, tf.int32)
            one = graph_edit.add(self.graph_def, f"{name}/one", "ExpandDims", [tensor, axis],
                                 T=dtype, Tdim=tf.int32)
            gathered = graph_edit.add(
                self.graph_def, f"{name}/gathered", "CollectiveGatherV2",
                [one, self.size, self.group, instance], T=dtype, communication_hint=self.hint,
                timeout_seconds=self.timeout_s, Nordering_token=0, is_stateless=False)
            # In replica order on every replica: the same sum whatever the arrival order.
            return graph_edit.add(self.graph_def, name, "Sum", [gathered, axis], T=dtype,
                                  Tidx=tf.int32, keep_dims=False)
        return graph_edit.add(
            self.graph_def, name, "CollectiveReduceV2", [tensor, self.size, self.group, instance],
            T=dtype, merge_op="Add", final_op="Id", communication_hint=self.hint,
            timeout_seconds=self.timeout_s, Nordering_token=0, is_stateless=False,
            max_subdivs_per_device=-1)
