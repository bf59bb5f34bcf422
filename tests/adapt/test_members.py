"""Planning for the current members, replacing stragglers: decisions without a cluster.

A stand-in run records the requests (as in test_policies); the plans are
checked against the rules every switch must pass (`elastic.check_switch`,
`elastic.check_elastic`), on the whole spec.
"""
from __future__ import annotations

import pytest

import autodist
from autodist import policies
from autodist.adapt import autoscaler
from autodist.adapt.members import lift, member_spec
from autodist.ir.errors import AutodistError
from autodist.runtime import elastic
from autodist.search import builders
from tests.doubles import StandInRun

BATCH, NODES = 48, 6


@pytest.fixture
def spec():
    return autodist.ResourceSpec.local(workers=4, ps=1)


@pytest.fixture
def ps_strategy(mlp_item, spec):
    return builders.PS().build(mlp_item, spec).with_virtual_nodes(BATCH, NODES)


def test_member_spec_keeps_the_members_and_the_ps(spec):
    sub = member_spec(spec, (0, 2, 3))
    assert sub.num_worker_tasks == 3 and sub.ps_devices == spec.ps_devices
    ports = {spec.task_of(i): n.port for i, n in enumerate(spec.nodes)}
    # The sub-spec's worker task j is members[j].
    for j, task in enumerate((0, 2, 3)):
        assert sub.nodes[sub.node_of_task("worker", j)].port == ports[("worker", task)]
    assert member_spec(spec, (0, 1, 2, 3)) == spec


def test_a_plan_for_the_members_is_lifted_to_the_whole_spec(mlp_item, spec, ps_strategy):
    members = (0, 2, 3)
    plan = builders.AllReduce().build(mlp_item, member_spec(spec, members))
    lifted = lift(plan, members, ps_strategy, spec)
    elastic.check_switch(ps_strategy, lifted, mlp_item, spec)
    elastic.check_elastic(lifted, spec)
    assert lifted.replicas == ps_strategy.replicas
    assert {s.WhichOneof("kind") for v in lifted.variables for s in v.shards} == {"all_reduce"}
    w0, _, w2, w3 = ps_strategy.replicas
    assert elastic.strategy_for(lifted, members).replicas == [w0, w2, w3]
    with pytest.raises(AutodistError, match=r"names worker task 3; the sub-cluster has tasks "
                                            r"0..2"):
        lift(builders.AllReduce().build(mlp_item, spec), members, ps_strategy, spec)


def test_replan_plans_for_the_current_members(mlp_item, spec, ps_strategy):
    seen = []

    def replanner(graph_item, sub_spec, current):
        seen.append(sub_spec)
        return builders.AllReduce().build(graph_item, sub_spec)

    run = StandInRun(mlp_item, ps_strategy, spec)
    control = policies.Control(run, BATCH, replanner)
    control.resize([0, 2, 3], replan=True)
    assert [s.num_worker_tasks for s in seen] == [3]
    kind, strategy = run.requests[-1]
    assert kind == "replan" and strategy.replicas == ps_strategy.replicas
    assert (strategy.global_batch_size, strategy.num_virtual_nodes) == (BATCH, NODES)
    assert [a["action"] for a in control.actions] == ["resize", "replan"]
    assert control.actions[0]["members"] == [0, 2, 3]


def test_replace_drops_stragglers_and_swaps_in_spares(mlp_item, spec, ps_strategy):
    run = StandInRun(mlp_item, ps_strategy, spec)
    control = policies.Control(run, BATCH)
    control.resize(3)
    control.replace([1])  # worker 3 is idle: it takes worker 1's place
    assert control.members == (0, 2, 3)
    control.replace([2, 3])  # no spare left but worker 1, which is not flagged
    assert control.members == (0, 1)
    control.replace([0])  # the chief stays
    assert control.members == (0, 1)
    assert control.actions[-1]["action"] == "keep_chief"
    assert run.requests == [("resize", 3), ("resize", [0, 2, 3]), ("resize", [0, 1])]


def _per_worker_metrics(step, members, slow):
    throughput = {t: 30.0 if t == slow else 100.0 for t in members}
    return policies.StepMetrics(step=step, epoch=0, loss=1.0, seconds=0.1,
                                examples_per_s=min(throughput.values()) * len(members),
                                workers=len(members), per_worker=throughput)


def test_autoscale_replaces_a_straggler(mlp_item, ps_strategy):
    spec = autodist.ResourceSpec.local(workers=3, ps=1)
    strategy = builders.PS().build(mlp_item, spec).with_virtual_nodes(BATCH, NODES)
    run = StandInRun(mlp_item, strategy, spec)
    control = policies.Control(run, BATCH)
    scale = policies.Autoscale(autoscaler.Autoscaler(autoscaler.StragglerReplacement(), 3, 3),
                               window=3, warmup=0)
    scale.on_train_begin(control)
    for step in range(8):
        control.metrics.append(_per_worker_metrics(step, control.members, slow=1))
        scale.on_step_end(control.metrics[-1], control)
    scale.on_train_end(control)
    assert scale.error is None and scale.result.replace == (1,)
    assert control.members == (0, 2) and run.requests == [("resize", [0, 2])]
    # Flagging the chief keeps it (and says so).
    run = StandInRun(mlp_item, strategy, spec)
    control = policies.Control(run, BATCH)
    scale = policies.Autoscale(autoscaler.Autoscaler(autoscaler.StragglerReplacement(), 3, 3),
                               window=3, warmup=0)
    scale.on_train_begin(control)
    for step in range(8):
        control.metrics.append(_per_worker_metrics(step, control.members, slow=0))
        scale.on_step_end(control.metrics[-1], control)
    scale.on_train_end(control)
    assert control.members == (0, 1, 2) and run.requests == []
    assert "keep_chief" in [a["action"] for a in control.actions]
