"""A task's step in one session run, or in two when it mixes collectives and PS work.

With collectives in the step, TensorFlow gives every worker's step the same
step id (collective graphs are coordinated); two workers' steps with one id
on a shared PS task abort each other ("Cleanup <step_id>"). So the PS
protocol then runs in a second session run without collectives (`ps_op`), on
gradients stashed in worker-local variables by the first (`train_op`).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import tensorflow as tf

from autodist.kernels import all_reduce_synchronizer, replica_sums
from autodist.kernels.program import Program, Shard, StorageRole
from autodist.kernels.sync_lowering import StepStart
from autodist.kernels.variables import StorageVariable, VariableSpec, create_variable


def needed(program: Program, all_reduce: Sequence[Shard], ps: Sequence[Shard]) -> bool:
    """Whether the step needs two runs: it has PS shards and collectives (its own
    all-reduce shards, or the step's sums over replicas)."""
    return bool(ps) and (bool(all_reduce) or program.step_collectives)


def stash_ps_gradients(program: Program, shards: Sequence[Shard], scaled):
    """Worker-local copies of the PS shards' gradients, written by the first run.

    Returns:
        (gradients read back from the stash, per replica and shard; the ops
        that write the stash).
    """
    reads: dict[int, dict[str, object]] = {}
    writes = []
    for replica in program.replicas:
        reads[replica.index] = dict(scaled[replica.index])
        for shard in shards:
            grad = scaled[replica.index].get(shard.name)
            if shard.kind != "ps" or grad is None:
                continue
            base = f"autodist/stash/{shard.name}/replica_{replica.index}"
            with tf.device(replica.device):
                if isinstance(grad, tf.IndexedSlices):
                    values = _stash_variable(program, f"{base}/values", grad.values.dtype)
                    indices = _stash_variable(program, f"{base}/indices", grad.indices.dtype)
                    writes += [values.assign(grad.values, read_value=False),
                               indices.assign(grad.indices, read_value=False)]
                    reads[replica.index][shard.name] = tf.IndexedSlices(
                        values.read_value(), indices.read_value(), grad.dense_shape)
                else:
                    dense = _stash_variable(program, base, grad.dtype)
                    writes.append(dense.assign(grad, read_value=False))
                    reads[replica.index][shard.name] = tf.reshape(dense.read_value(),
                                                                  shard.shape)
    return reads, writes


def _stash_variable(program: Program, name: str, dtype: tf.DType) -> StorageVariable:
    # Any shape: sparse gradients change their row count every step. Placed by
    # the caller's device scope (its replica's device).
    var = create_variable(program.graph, VariableSpec(name, None, dtype, "", 0,
                                                      initial_shape=(0,)))
    program.storage[name] = var
    program.roles[name] = StorageRole("internal")
    return var


def forward_ops(program: Program) -> list[tf.Operation]:
    """The ops whose completion means this task's replicas have done all their reads.

    Every read that runs in a step feeds a replica's loss, gradients or state
    updates (nothing else of the imported step is fetched). In one run with
    the forward pass, a refresh of a local copy must also wait for these.
    """
    ops = []
    for replica in program.replicas:
        ops.append(replica.loss.op)
        for grad in replica.gradients.values():
            if isinstance(grad, tf.IndexedSlices):
                ops += [grad.values.op, grad.indices.op]
            else:
                ops.append(grad.op)
        ops += [u if isinstance(u, tf.Operation) else u.op for u in replica.state_updates]
    return ops


def train_ops(step: StepStart, first: list, stashes: list, ps_work: list, two_phase: bool,
              all_reduces: bool) -> tuple[tf.Operation, tf.Operation | None]:
    """The step's runs: (train_op, ps_op), ps_op None in a one-run step.

    Args:
        step: The task's step.
        first: What runs with the collectives: the all-reduce updates, version
            tag and state updates.
        stashes: The writes of the stashed PS gradients (two runs only).
        ps_work: The PS protocol's ops.
        two_phase: The step runs in two (`needed`).
        all_reduces: The strategy all-reduces some shard.
    """
    program = step.program
    if not two_phase:
        with tf.control_dependencies(first + ps_work):
            train_op = tf.group(step.step.assign_add(1, read_value=False),
                                name="autodist/train_op")
        return train_op, None
    first = first + stashes + [r.loss for r in program.replicas]
    if not all_reduces:
        # The step's own sums over replicas may come before some reads of PS
        # variables; every worker's collective run shares one step id, and the
        # first to finish would clean up the PS's part of the others'. A last
        # collective, after all of each replica's work, ends them together.
        first = barrier(step, first)
    train_op = tf.group(first, name="autodist/train_op")
    with tf.control_dependencies(ps_work):
        ps_op = tf.group(step.step.assign_add(1, read_value=False), name="autodist/ps_op")
    return train_op, ps_op


def barrier(step: StepStart, after: list) -> list:
    """One collective per replica, run after `after`: no replica's collective run ends
    before every replica's work is done."""
    options = step.options
    config = all_reduce_synchronizer.CollectiveConfig(len(step.strategy.replicas),
                                                      options.timeout_s, options.version)
    config = dataclasses.replace(config, version=options.version + replica_sums.GROUP_KEY -
                                 all_reduce_synchronizer.GROUP_KEY)
    out = []
    for replica in step.program.replicas:
        with tf.device(replica.device), tf.control_dependencies(after):
            out.append(all_reduce_synchronizer.collective_sum(
                tf.zeros([], tf.float32), tf.constant(replica_sums.BARRIER_KEY), config).op)
    return out
