"""Planning for the current members of an elastic run (a sub-cluster of its spec).

An elastic run may go on with some of its spec's worker tasks, e.g. (0, 2, 3)
after worker 1 left. A fresh plan for them is a plan for the spec restricted
to those workers (`member_spec`: PS-only nodes kept), whose worker task j is
the run's task members[j]. The run switches strategies only between
strategies of the whole spec (same replicas, same virtual nodes:
`elastic.check_switch`), so the plan is lifted back (`lift`): its devices
renamed to the run's tasks, and the idle tasks given the replicas they had,
to be used if they rejoin. The run gives each membership the lifted plan on
its members (`elastic.strategy_for`), which is the plan itself.
"""
from __future__ import annotations

from autodist.ir.device_names import DeviceName
from autodist.ir.errors import AutodistError
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy


def member_spec(spec: ResourceSpec, members: tuple[int, ...]) -> ResourceSpec:
    """`spec` with only the worker nodes whose task is in `members` (and every PS-only node).

    The nodes keep their order, so the sub-spec's worker task j is members[j]
    (sorted, the chief first) and its PS tasks are the spec's.
    """
    return spec.with_worker_tasks(members)


def lift(plan: Strategy, members: tuple[int, ...], like: Strategy,
         spec: ResourceSpec) -> Strategy:
    """A plan made for `member_spec(spec, members)` as a strategy of the whole `spec`.

    Args:
        plan: The plan for the sub-spec (its worker task j is members[j]).
        members: The run's member worker tasks, sorted.
        like: The run's current strategy (whole spec): the idle tasks get its
            replicas, and the result its global batch, virtual nodes and
            hyper-parameter overrides.
        spec: The run's spec.

    Raises:
        AutodistError: the plan names a worker task the sub-spec does not have.
    """
    outside = sorted(d.index for d in plan.devices()
                     if d.job == "worker" and d.index >= len(members))
    if outside:
        raise AutodistError(f"the plan for members {list(members)} names worker task "
                            f"{outside[0]}; the sub-cluster has tasks 0..{len(members) - 1}")
    out = plan.with_worker_tasks_renumbered(dict(enumerate(members)))
    idle = [d for d in like.replicas if _task(d) not in members]
    batch = {} if like.global_batch_size is None else {
        "global_batch_size": like.global_batch_size, "num_virtual_nodes": like.num_virtual_nodes}
    out = out.with_replicas(sorted(out.replicas + idle, key=_task), **batch)
    out.proto.resource_spec_fingerprint = spec.fingerprint
    return out.with_hyperparameters(**like.hyperparameters)


def _task(device: str) -> int:
    return DeviceName.parse(device).index
