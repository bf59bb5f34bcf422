"""Pictures: the strategy figure, its numbers, the scaling curve, the bench's error bars.

Figures are checked by their artists and labels, not pixels. Workloads are
synthetic GraphItems (no TensorFlow).
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from autodist.ir.errors import AutodistError, InvalidArgumentError, StrategyError
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy
from autodist.plotting import (MissingExtraError, plot_scaling_curve, plot_strategy,
                               scaling_samples, strategy_layout)
from autodist.search import builders
from autodist.search.simulator import Simulator
from autodist.search.space import SearchSpace
from tests.search.workloads import graph_item, many_variables

pytest.importorskip("matplotlib")

PS0, PS1 = "/job:ps/task:0/device:CPU:0", "/job:ps/task:1/device:CPU:0"
W0, W1 = "/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"


@pytest.fixture(scope="module")
def item():
    """An embedding (sparse, 400 kB), a dense kernel and a bias; Adam."""
    return graph_item([("emb", (10000, 10), True), ("kernel", (100, 50), False),
                       ("bias", (50,), False)], optimizer="adam", slots=("m", "v"),
                      flops=1e8)


@pytest.fixture(scope="module")
def spec():
    return ResourceSpec.local(workers=2, ps=2, bandwidth_gbps=1.0, cpu_memory=0)


def _mixed(item, spec) -> Strategy:
    """The embedding split over both PS, the kernel all-reduced, the bias on async PS."""
    strategy = builders.AllReduce().build(item, spec)
    emb = strategy.variable("emb")
    emb.partitioner.axis, emb.partitioner.num_shards = 0, 2
    del emb.shards[:]
    for device in (PS0, PS1):
        emb.shards.add().ps.reduction_destination = device
        emb.shards[-1].ps.sync = True
    bias = strategy.variable("bias")
    bias.shards[0].ps.reduction_destination = PS1
    bias.shards[0].ps.sync = False
    strategy.proto.origin = "hand-made"
    return strategy


def test_layout_says_who_holds_what(item, spec):
    strategy = _mixed(item, spec)
    strategy.validate(item, spec)
    layout = strategy_layout(strategy, item, spec)
    assert layout.devices == [W0, W1, PS0, PS1]
    assert [(h.variable, h.shard, h.num_shards, h.role, h.family)
            for h in layout.held_by(PS0)] == [("emb", 0, 2, "ps", "PS sync")]
    assert {(h.variable, h.shard) for h in layout.held_by(PS1)} == {("emb", 1), ("bias", 0)}
    assert {h.variable for h in layout.held_by(W0)} == {"kernel"}
    assert layout.held_by(W1)[0].role == "replica"
    assert layout.families == {"emb": "PS sync", "kernel": "all-reduce", "bias": "PS async"}
    emb_bytes = sum(h.nbytes for h in layout.holdings if h.variable == "emb")
    assert emb_bytes == item.variable("emb").byte_size
    # Memory per pool from the search's memory model: the PS hosts hold the embedding.
    pools = {p.name: p.nbytes for p in layout.memory}
    assert pools["host memory of /job:ps/task:0"] > item.variable("emb").byte_size / 2


@pytest.mark.parametrize("builder", ["PS", "PartitionedPS", "AllReduce", "Parallax"])
def test_bytes_per_link_are_the_simulators(item, spec, builder):
    """Each link's bytes are the sums the simulator's prediction is made of."""
    strategy = builders.get(builder)().build(item, spec)
    layout = strategy_layout(strategy, item, spec)
    prediction = Simulator(SearchSpace(item, spec)).predict_strategy(strategy)
    total = sum(link.bytes_in + link.bytes_out for link in layout.links)
    busiest = max(max(link.bytes_in, link.bytes_out) for link in layout.links)
    assert total == pytest.approx(prediction.parts["sum_node_bytes"][0])
    assert busiest == pytest.approx(prediction.parts["max_node_bytes"][0])
    assert layout.predicted_step_time_s == pytest.approx(prediction.step_time_s[0])
    for link in layout.links:   # the families add up to the link
        assert sum(b[0] for b in link.by_family.values()) == pytest.approx(link.bytes_in)
        assert link.seconds == pytest.approx(max(link.bytes_in, link.bytes_out) / 1.25e8)
    assert [link.task for link in layout.links] == ["worker:0", "worker:1", "ps:0", "ps:1"]


def test_figure_shows_devices_variables_synchronizers_and_links(item, spec, tmp_path):
    strategy = _mixed(item, spec)
    path = tmp_path / "s.png"
    fig = plot_strategy(strategy, item, spec, path=path)
    assert path.stat().st_size > 10_000
    holdings = next(ax for ax in fig.axes if ax.get_gid() == "holdings")
    links = next(ax for ax in fig.axes if ax.get_gid() == "links")
    columns = [t.get_text() for t in holdings.get_xticklabels()]
    assert [c.splitlines()[0] for c in columns] == ["worker:0 CPU:0", "worker:1 CPU:0",
                                                    "ps:0 CPU:0", "ps:1 CPU:0"]
    assert all(len(c.splitlines()) == 2 for c in columns)   # each pool's bytes
    rows = [t.get_text() for t in holdings.get_yticklabels()]
    assert rows[0].startswith("emb (PS sync, 400 kB") and rows[1].startswith("kernel (all-reduce")
    assert rows[2].startswith("bias (PS async")
    legend = [t.get_text() for t in holdings.get_legend().get_texts()]
    assert legend == ["PS sync", "PS async", "all-reduce"]
    # One square per holding: the kernel on both replicas, 2 embedding shards, the bias.
    squares = {c.get_label(): len(c.get_offsets()) for c in holdings.collections}
    assert squares == {"PS sync": 2, "PS async": 1, "all-reduce": 2}
    assert sorted(t.get_text() for t in holdings.texts) == ["1/2", "2/2"]
    # Bytes per link: bars stacked by family, in and out per node, and the link times.
    assert [t.get_text().splitlines()[0] for t in links.get_xticklabels()] == [
        "worker:0", "worker:1", "ps:0", "ps:1"]
    layout = strategy_layout(strategy, item, spec)
    heights = np.zeros(4)
    for container in links.containers:
        if container.get_label().endswith(" in"):
            heights += [bar.get_height() for bar in container]
    assert heights == pytest.approx([link.bytes_in for link in layout.links])
    assert len(links.texts) == 4 and all(t.get_text().endswith("s") for t in links.texts)
    assert "hand-made" in fig._suptitle.get_text()


def test_figure_without_the_workload_draws_holdings_only(item, spec):
    strategy = builders.get("Parallax")().build(item, spec)
    fig = plot_strategy(strategy)
    assert [ax.get_gid() for ax in fig.axes] == ["holdings"]
    assert any("pass the GraphItem and ResourceSpec" in t.get_text() for t in fig.texts)
    with pytest.raises(InvalidArgumentError, match="both graph_item and resource_spec"):
        strategy_layout(strategy, item)


def test_a_strategy_for_another_cluster_is_refused(item, spec):
    strategy = builders.get("PS")().build(item, spec)
    with pytest.raises(StrategyError):
        plot_strategy(strategy, item, ResourceSpec.local(workers=1, ps=0, cpu_memory=0))


def test_many_variables_draw_the_largest(spec):
    item = many_variables(60)
    strategy = builders.AllReduce().build(item, spec)
    fig = plot_strategy(strategy, item, spec, max_variables=10)
    holdings = fig.axes[0]
    assert len(holdings.get_yticks()) == 10
    assert "50 smaller variables not drawn" in holdings.get_title(loc="left")
    largest = sorted(item.variables, key=lambda v: -v.byte_size)[:10]
    drawn = {t.get_text().split(" (")[0] for t in holdings.get_yticklabels()}
    assert drawn == {v.name for v in largest}


def test_without_matplotlib_the_error_names_the_extra(item, spec, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    strategy = builders.AllReduce().build(item, spec)
    with pytest.raises(MissingExtraError, match=r'pip install "autodist\[plot\]"') as raised:
        plot_strategy(strategy, item, spec)
    assert isinstance(raised.value, ImportError) and isinstance(raised.value, AutodistError)
    with pytest.raises(MissingExtraError):
        plot_scaling_curve({1: 10.0})
    # The numbers need no matplotlib.
    assert strategy_layout(strategy, item, spec).links


def test_plan_plot_draws_the_plan(item, spec, tmp_path):
    from autodist.api import Plan
    from autodist.search.tuner import TuneResult

    result = TuneResult(strategy=builders.get("Parallax")().build(item, spec),
                        predicted_step_time_s=0.01, lower_bound_s=0.005,
                        builder_step_times_s={}, trials=[], candidates_scored=1, elapsed_s=0.1)
    plan = Plan(None, item, spec, result, batch_size=64)
    fig = plan.plot(tmp_path / "plan.png")
    assert (tmp_path / "plan.png").exists()
    links = next(ax for ax in fig.axes if ax.get_gid() == "links")
    assert "batch 64" in links.get_xlabel()


def test_scaling_curve_from_the_autoscaler(tmp_path):
    from autodist.adapt.autoscaler import Autoscaler, ScalingCurve, ScalingEfficiency

    measured = {1: 100.0, 2: 180.0, 3: 190.0, 4: 185.0}
    result = Autoscaler(ScalingEfficiency(0.5), 1, 4).run(lambda n: measured[n], start=1)
    fig = plot_scaling_curve(result, predicted={1: 90.0, 2: 170.0, 3: 200.0, 4: 210.0},
                             path=tmp_path / "curve.png")
    assert (tmp_path / "curve.png").exists()
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[:4] == ["measured", "measured median", "linear from 1 worker", "predicted"]
    assert f"chosen: {result.workers}" in labels
    median = next(line for line in ax.lines if line.get_label() == "measured median")
    assert list(median.get_xdata()) == sorted({t.workers for t in result.trials})
    assert [t.get_text() for t in ax.texts] == [str(k + 1) for k in range(len(result.trials))]
    # Repeats of a size: every one a dot, the median on the line.
    curve = ScalingCurve()
    for n, value in ((1, 10.0), (1, 14.0), (1, 12.0), (2, 20.0)):
        curve.record(n, value)
    assert scaling_samples(curve) == {1: [10.0, 14.0, 12.0], 2: [20.0]}
    ax = plot_scaling_curve(curve).axes[0]
    assert len(ax.collections[0].get_offsets()) == 4
    median = next(line for line in ax.lines if line.get_label() == "measured median")
    assert list(median.get_ydata()) == [12.0, 20.0]
    assert scaling_samples({2: [1.0, 2.0], 1: 3}) == {1: [3.0], 2: [1.0, 2.0]}


@pytest.mark.parametrize("curve,message", [
    ({}, "holds no measurement"),
    ({1: -1.0}, "must be finite and >= 0"),
    ({1: float("nan")}, "must be finite and >= 0"),
    ("curve", "a ScalingCurve, a ScalingResult or a mapping"),
])
def test_scaling_curve_errors(curve, message):
    with pytest.raises(InvalidArgumentError, match=message):
        plot_scaling_curve(curve)


def test_bench_figure_has_min_max_error_bars(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from autodist.bench import emulated

    rows = []
    for system, strategy, times in ((emulated.AUTODIST, "PS", (0.010, 0.012, 0.020)),
                                    (emulated.OPTIMIZE, "optimize", (0.008, 0.009, 0.011)),
                                    (emulated.SINGLE, "Keras", (0.004, 0.005, 0.006))):
        row = emulated.Row("mlp", 100.0, 2, 1, 64, system, strategy)
        row.set_times(times)
        rows.append(row)
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert emulated.plot(rows, str(tmp_path / "e.png"))
    ax = figures[0].axes[0]
    bars = {c.get_label(): c for c in ax.containers if hasattr(c, "errorbar")}
    whiskers = bars["best builder"].errorbar.lines[2][0].get_segments()[0]
    assert [y for _, y in whiskers] == pytest.approx([10.0, 20.0])   # min and max, ms
    assert "min–max" in ax.get_ylabel()
