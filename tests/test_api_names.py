"""Renamed public names keep working, each with a DeprecationWarning naming the new one.

Modules moved to names that say what they hold, constants and classes
renamed where two concepts shared a name, `optimize`'s arguments named as
`distribute`'s and the CLI's, and `Plan`'s seconds with their `_s`. Also
`Plan.fit` passing every `DistributedRun` option on. No TensorFlow: the
search runs on a synthetic GraphItem, the run is a recorder.
"""
from __future__ import annotations

import importlib
import sys
import types

import pytest

import autodist
from autodist import api
from autodist.ir.resource_spec import ResourceSpec
from autodist.search.measurement import SimulatedRunner
from tests.search import workloads

MOVED_MODULES = [
    ("autodist.search.runner", "autodist.search.measurement", "SimulatedRunner"),
    ("autodist.runtime.runner", "autodist.runtime.local_runner", "LocalRunner"),
    ("autodist.launch.netns", "autodist.launch.private_network", "local_network"),
    ("autodist.bench.netns", "autodist.bench.capped_links", "capped_spec"),
    ("autodist.adapt.policies", "autodist.adapt.builtin_policies", "ScheduledResize"),
    ("autodist.adapt.policy", "autodist.adapt.policy_interface", "Control"),
]


@pytest.mark.parametrize("old, new, name", MOVED_MODULES, ids=[m[0] for m in MOVED_MODULES])
def test_a_moved_module_warns_and_forwards(old, new, name):
    sys.modules.pop(old, None)   # the warning comes with the (first) import
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated; import {new}"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


RENAMED = [
    ("autodist.search.measure_callback", "Trial", "StrategyTrial"),
    ("autodist.search.tuner", "Trial", "StrategyTrial"),
    ("autodist.adapt.autoscaler", "Trial", "ScalingTrial"),
    ("autodist.search.builders", "BUILDERS", "STRATEGY_BUILDERS"),
    ("autodist.models", "BUILDERS", "MODEL_FACTORIES"),
    ("autodist.bench.synthetic", "BUILDERS", "GRAPH_ITEM_FACTORIES"),
]


@pytest.mark.parametrize("module_name, old, new", RENAMED,
                         ids=[f"{m}.{o}" for m, o, _ in RENAMED])
def test_a_renamed_name_warns_and_is_the_new_one(module_name, old, new):
    module = importlib.import_module(module_name)
    with pytest.warns(DeprecationWarning, match=f"{module_name}.{old} is deprecated; use "
                                                f"{module_name}.{new}"):
        value = getattr(module, old)
    assert value is getattr(module, new)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        module.NoSuchName  # noqa: B018


def test_the_two_trials_are_two_names():
    from autodist.adapt.autoscaler import ScalingTrial
    from autodist.search.measure_callback import StrategyTrial

    assert ScalingTrial(2, 10.0).throughput == 10.0
    assert StrategyTrial(strategy=None, predicted_step_time_s=0.1).origin == "search"


# ------------------------------------------------------------- optimize
@pytest.fixture(name="workload")
def _workload():
    gi = workloads.graph_item([("kernel", (256, 256), False), ("bias", (256,), False)],
                              flops=1e7)
    return gi, ResourceSpec.local(workers=2, ps=1, bandwidth_gbps=1)


def test_optimize_spec_is_resource_spec(workload):
    gi, spec = workload
    with pytest.warns(DeprecationWarning, match=r"optimize\(spec=...\) is deprecated; use "
                                                r"resource_spec="):
        old = autodist.optimize(None, spec=spec, graph_item=gi, cost_model="simulator",
                                search_budget=50)
    new = autodist.optimize(None, resource_spec=spec, graph_item=gi, cost_model="simulator",
                            search_budget=50)
    assert old.resource_spec is spec
    assert list(old.strategy.proto.variables) == list(new.strategy.proto.variables)
    with pytest.raises(ValueError, match="give resource_spec= or its deprecated name spec="):
        autodist.optimize(None, spec, spec=spec, graph_item=gi)


def test_optimize_budget_is_trials(workload, monkeypatch):
    gi, spec = workload
    monkeypatch.setattr("autodist.runtime.local_runner.LocalRunner",
                        lambda model, spec, graph_item, batch_size, allow_exposed:
                        SimulatedRunner(graph_item, spec))
    with pytest.warns(DeprecationWarning, match=r"optimize\(budget=...\) is deprecated; use "
                                                r"trials="):
        plan = autodist.optimize(None, spec, graph_item=gi, measure=True, budget=2,
                                 cost_model="simulator", search_budget=50)
    assert len(plan.trials) == 2
    assert len(autodist.optimize(None, spec, graph_item=gi, measure=True, trials=1,
                                 cost_model="simulator", search_budget=50).trials) == 1
    with pytest.warns(DeprecationWarning), \
            pytest.raises(ValueError, match="trials counts measured trials; pass measure=True"):
        autodist.optimize(None, spec, graph_item=gi, budget=3)


# ----------------------------------------------------------------- Plan
@pytest.fixture(name="plan")
def _plan(workload):
    gi, spec = workload
    return autodist.optimize(None, spec, graph_item=gi, cost_model="simulator",
                             search_budget=50, allow_exposed=True)


@pytest.mark.parametrize("old", ["predicted_step_time", "lower_bound_step_time",
                                 "builder_step_times", "search_time"])
def test_plan_seconds_carry_their_unit(plan, old):
    with pytest.warns(DeprecationWarning, match=f"Plan.{old} is deprecated; use "
                                                f"Plan.{old}_s"):
        value = getattr(plan, old)
    assert value == getattr(plan, f"{old}_s")
    assert plan.predicted_step_time_s > 0 and plan.search_time_s > 0
    assert "ms/step" in repr(plan)


class _RecordingRun:
    """Stands in for DistributedRun: what reached the run and what reached its fit."""

    made: list[dict] = []

    def __init__(self, model, strategy, resource_spec, *, graph_item=None, job_dir=None,
                 step_timeout_s=60.0, startup_timeout_s=120.0, task_step_delay_s=None,
                 launch="local", allow_exposed=False, secret_file=None,
                 keep_optimizer_state=True):
        self.options = dict(launch=launch, secret_file=secret_file, job_dir=job_dir,
                            allow_exposed=allow_exposed,
                            keep_optimizer_state=keep_optimizer_state)
        _RecordingRun.made.append(self.options)

    def fit(self, *args, **kwargs):
        return types.SimpleNamespace(args=args, kwargs=kwargs, run=self.options)


def test_plan_fit_passes_every_run_option_on(plan, monkeypatch):
    names = api._run_option_names()
    assert {"launch", "secret_file", "job_dir", "step_timeout_s", "startup_timeout_s",
            "allow_exposed", "task_step_delay_s", "keep_optimizer_state"} <= names
    assert "graph_item" not in names
    monkeypatch.setattr(api, "DistributedRun", _RecordingRun)
    out = plan.fit("x", "y", batch_size=8, epochs=2, launch="remote",
                   secret_file="/run/secret", keep_optimizer_state=False)
    assert out.run == dict(launch="remote", secret_file="/run/secret", job_dir=None,
                           allow_exposed=True, keep_optimizer_state=False)
    assert out.args == ("x", "y") and out.kwargs == {"batch_size": 8, "epochs": 2}
    assert plan.fit("x", allow_exposed=False).run["allow_exposed"] is False
