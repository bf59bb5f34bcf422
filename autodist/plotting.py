"""Pictures: a strategy on its cluster, and the autoscaler's scaling curve.

Drawing needs matplotlib, an optional dependency (`pip install
"autodist[plot]"`); it is imported when a function draws, and its absence
raises `MissingExtraError` naming the extra. The numbers behind a picture
come without matplotlib: `strategy_layout` says which device holds which
variable or shard, how each is synchronized and, with a GraphItem and a
ResourceSpec, the bytes every node's link moves in a step and each memory
pool's bytes, from the search's own simulator and memory model (the
numbers the search ranks strategies with; `autodist strategy show --json`
prints them).

Figures are `matplotlib.figure.Figure` objects made without pyplot (no
global figure state); `path=` saves one, and a notebook displays the
returned figure.

Example:
    >>> plan = autodist.optimize(model)                     # doctest: +SKIP
    >>> plan.plot("plan.png")                               # doctest: +SKIP
    >>> from autodist.plotting import plot_strategy
    >>> fig = plot_strategy(strategy, graph_item, spec)     # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from autodist.ir.device_names import DeviceName, DeviceNameError
from autodist.ir.errors import AutodistError, InvalidArgumentError
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy, Synchronizer, enum_name, is_gathered
from autodist.proto import strategy_pb2
from autodist.search.memory import format_bytes, shard_sizes

if TYPE_CHECKING:  # pragma: no cover - types only
    from matplotlib.figure import Figure

    from autodist.adapt.autoscaler import ScalingCurve, ScalingResult

PLOT_EXTRA = "plot"
# Synchronizer families and their colours (one legend entry each).
SYNC_COLORS = {
    "PS sync": "tab:blue",
    "PS stale": "tab:purple",
    "PS async": "tab:orange",
    "all-reduce": "tab:green",
    "all-gather": "tab:olive",
}
_AllReduce = strategy_pb2.AllReduceSynchronizer


class MissingExtraError(AutodistError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require_matplotlib():
    """Imports matplotlib's `Figure` class, or raises MissingExtraError naming the extra.

    Returns:
        `matplotlib.figure.Figure`.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingExtraError(
            f"drawing needs matplotlib, which is not installed ({e}); install autodist's "
            f"'{PLOT_EXTRA}' extra: pip install \"autodist[{PLOT_EXTRA}]\" (or pip install "
            "matplotlib)") from e
    return Figure


# ------------------------------------------------------------------ the data
@dataclasses.dataclass(frozen=True)
class Holding:
    """One device holding one variable or shard.

    Attributes:
        variable: The variable's name.
        device: The device that holds it.
        shard: Index of the shard (0 for an unsplit variable).
        num_shards: Shards of the variable.
        role: "ps" (a parameter server holds the one copy and applies its
            update) or "replica" (every replica holds a mirrored copy, kept
            equal by all-reduce or all-gather).
        nbytes: The shard's bytes (None without a GraphItem).
        synchronizer: The shard's synchronizer in words
            (`ir.strategy.describe_synchronizer`'s form).
        family: Its family: a key of `SYNC_COLORS`.
    """

    variable: str
    device: str
    shard: int
    num_shards: int
    role: str
    nbytes: float | None
    synchronizer: str
    family: str


@dataclasses.dataclass(frozen=True)
class LinkTraffic:
    """Bytes one node's network link moves in one step, as the simulator counts them.

    Attributes:
        node: Index of the node in the ResourceSpec.
        task: The node's task, e.g. "worker:0".
        bandwidth_gbps: The link's bandwidth.
        bytes_in: Bytes received per step.
        bytes_out: Bytes sent per step.
        by_family: Synchronizer family -> (bytes in, bytes out).
    """

    node: int
    task: str
    bandwidth_gbps: float
    bytes_in: float
    bytes_out: float
    by_family: dict[str, tuple[float, float]]

    @property
    def seconds(self) -> float:
        """Time of the busier direction at the link's bandwidth (full duplex)."""
        return max(self.bytes_in, self.bytes_out) / (self.bandwidth_gbps * 1e9 / 8)


@dataclasses.dataclass(frozen=True)
class PoolMemory:
    """One memory pool's bytes under the strategy (`autodist.search.memory`)."""

    name: str
    devices: tuple[str, ...]
    nbytes: float
    capacity_bytes: float | None


@dataclasses.dataclass(frozen=True)
class StrategyLayout:
    """What a strategy puts where: the data `plot_strategy` draws.

    Attributes:
        strategy_id, origin: The strategy's.
        devices: Every device that holds something (replicas, parameter
            servers), in the cluster's order.
        variables: The strategy's variables, in its order.
        families: Variable -> its synchronizer family ("mixed: a + b" when
            its shards differ).
        holdings: Who holds what.
        links: Per node, bytes per step (None without a GraphItem and a
            ResourceSpec).
        memory: Per memory pool, its bytes (None without them).
        batch_size: The global batch the bytes are counted at (sparse
            gradients move rows per example).
        predicted_step_time_s: The simulator's step time (None without them).
    """

    strategy_id: str
    origin: str
    devices: list[str]
    variables: list[str]
    families: dict[str, str]
    holdings: list[Holding]
    links: list[LinkTraffic] | None = None
    memory: list[PoolMemory] | None = None
    batch_size: int | None = None
    predicted_step_time_s: float | None = None

    def held_by(self, device: str) -> list[Holding]:
        """What one device holds."""
        return [h for h in self.holdings if h.device == device]

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able dict (the `layout` of `autodist strategy show --json`)."""
        def number(x: float | None) -> float | None:
            return None if x is None or not math.isfinite(x) else float(x)

        return {
            "devices": [{"device": d, "holds": [
                {"variable": h.variable, "shard": h.shard, "num_shards": h.num_shards,
                 "role": h.role, "bytes": number(h.nbytes), "synchronizer": h.synchronizer,
                 "family": h.family} for h in self.held_by(d)]} for d in self.devices],
            "variables": [{"name": v, "family": self.families[v]} for v in self.variables],
            "links": None if self.links is None else [
                {"node": link.node, "task": link.task, "bandwidth_gbps": link.bandwidth_gbps,
                 "bytes_in_per_step": link.bytes_in, "bytes_out_per_step": link.bytes_out,
                 "seconds_per_step": link.seconds} for link in self.links],
            "memory": None if self.memory is None else [
                {"pool": p.name, "devices": list(p.devices), "bytes": p.nbytes,
                 "capacity_bytes": number(p.capacity_bytes)} for p in self.memory],
            "batch_size": self.batch_size,
            "predicted_step_time_s": number(self.predicted_step_time_s),
        }


def synchronizer_family(sync: Synchronizer, sparse_gradient: bool = False) -> str:
    """The family of one shard's synchronizer: a key of `SYNC_COLORS`."""
    if sync.WhichOneof("kind") == "ps":
        if not sync.ps.sync:
            return "PS async"
        return "PS stale" if sync.ps.staleness else "PS sync"
    ar = sync.all_reduce
    if is_gathered(ar, sparse_gradient) or ar.spec == _AllReduce.ALL_GATHER:
        return "all-gather"
    return "all-reduce"


def _describe(sync: Synchronizer, family: str) -> str:
    """A short description of a shard's synchronizer for labels and JSON."""
    if sync.WhichOneof("kind") == "ps":
        ps = sync.ps
        mode = ("async" if not ps.sync else f"stale<={ps.staleness}" if ps.staleness
                else "sync")
        return f"PS {mode}" + (", local copies" if ps.local_replication else "")
    ar = sync.all_reduce
    text = family
    if ar.compressor != _AllReduce.NONE:
        text += f", {enum_name(_AllReduce.Compressor, ar.compressor).lower()}"
    return f"{text}, group {ar.group}"


def _device_order(devices: Iterable[str], spec: ResourceSpec | None) -> list[str]:
    order = {d: i for i, d in enumerate(spec.device_names)} if spec is not None else {}
    return sorted(set(devices), key=lambda d: (order.get(d, len(order)), d))


def strategy_layout(strategy: Strategy, graph_item: GraphItem | None = None,
                    resource_spec: ResourceSpec | None = None, *,
                    batch_size: int | None = None) -> StrategyLayout:
    """Who holds what under `strategy` and, given the workload, the bytes per link.

    Args:
        strategy: The strategy.
        graph_item: The model's capture; with `resource_spec`, the bytes of
            every shard, every node's link and every memory pool. The
            strategy is validated against both first.
        resource_spec: The cluster.
        batch_size: The global batch the bytes are counted at (default: the
            capture's estimate batch per replica, as the search's default).

    Raises:
        StrategyError: The strategy does not fit the GraphItem or cluster.
        InvalidArgumentError: Only one of graph_item and resource_spec was given.
    """
    if (graph_item is None) != (resource_spec is None):
        raise InvalidArgumentError(
            "strategy_layout needs both graph_item and resource_spec for bytes, or neither. "
            f"Received: graph_item={graph_item!r}, resource_spec={resource_spec!r}")
    if graph_item is not None:
        strategy.validate(graph_item, resource_spec)
    replicas = strategy.replicas
    holdings: list[Holding] = []
    families: dict[str, str] = {}
    for config in strategy.variables:
        var = graph_item.variable(config.var_name) if graph_item is not None else None
        sparse = bool(var is not None and var.sparse_gradient)
        sizes = shard_sizes(var, config) if var is not None else None
        seen = []
        for k, sync in enumerate(config.shards):
            family = synchronizer_family(sync, sparse)
            if family not in seen:
                seen.append(family)
            nbytes = None
            if var is not None:   # (validated: one size per shard)
                nbytes = float(var.byte_size) * sizes[k] / max(1, sum(sizes))
            describe = _describe(sync, family)
            where = ([(sync.ps.reduction_destination, "ps")]
                     if sync.WhichOneof("kind") == "ps" else [(d, "replica") for d in replicas])
            for device, role in where:
                holdings.append(Holding(config.var_name, device, k, len(config.shards), role,
                                        nbytes, describe, family))
        families[config.var_name] = seen[0] if len(seen) == 1 else "mixed: " + " + ".join(seen)
    layout = StrategyLayout(
        strategy_id=strategy.id, origin=strategy.origin,
        devices=_device_order([*replicas, *(h.device for h in holdings),
                               *(resource_spec.ps_devices if resource_spec else ())],
                              resource_spec),
        variables=[c.var_name for c in strategy.variables], families=families,
        holdings=holdings)
    if graph_item is None:
        return layout
    links, memory, used_batch, predicted = _simulated(strategy, graph_item, resource_spec,
                                                      batch_size)
    return dataclasses.replace(layout, links=links, memory=memory, batch_size=used_batch,
                               predicted_step_time_s=predicted)


def _simulated(strategy: Strategy, graph_item: GraphItem, spec: ResourceSpec,
               batch_size: int | None
               ) -> tuple[list[LinkTraffic], list[PoolMemory], int, float]:
    """Per node link bytes and per pool memory from the search's simulator tables.

    The simulator keeps, per variable option, a row of bytes in and out of
    each node (parameter-server pulls and pushes) and the bytes of each
    fused all-reduce group and all-gather; its step time sums these rows
    and adds the collectives' ring traffic on every node that runs
    replicas. The same sums, kept per variable, give each link's bytes and
    what each synchronizer family contributes (tests check them against the
    prediction's `sum_node_bytes` and `max_node_bytes`).
    """
    import numpy as np

    from autodist.search.simulator import Simulator
    from autodist.search.space import SearchSpace, SpaceOptions

    # A lean space: only the strategy's own choices are scored.
    lean = SpaceOptions(max_shards=1, max_groups=1, allow_local_replication=False,
                        allow_hybrid=False)
    space = SearchSpace(graph_item, spec, lean, batch_size)
    simulator = Simulator(space)
    candidate = space.encode(strategy)
    prediction = simulator.predict(candidate[None, :])
    # The simulator's own per-variable bytes: the numbers its prediction sums
    # (tests/test_plotting.py checks the sums against it).
    traffic_in, traffic_out = simulator.node_traffic(candidate)
    by_name = {c.var_name: c for c in strategy.variables}
    n = simulator.num_nodes
    totals = {"in": np.zeros(n), "out": np.zeros(n)}
    families: dict[str, dict[str, np.ndarray]] = {}
    for v, var in enumerate(space.variables):
        node_in, node_out = traffic_in[v], traffic_out[v]
        config = by_name[var.name]
        kinds = {synchronizer_family(s, var.sparse_gradient) for s in config.shards}
        family = kinds.pop() if len(kinds) == 1 else "mixed"
        slot = families.setdefault(family, {"in": np.zeros(n), "out": np.zeros(n)})
        slot["in"] += node_in
        slot["out"] += node_out
        totals["in"] += node_in
        totals["out"] += node_out
    links = []
    for node in range(n):
        job, task = spec.task_of(node)
        links.append(LinkTraffic(
            node=node, task=f"{job}:{task}", bandwidth_gbps=spec.bandwidth_gbps(node),
            bytes_in=float(totals["in"][node]), bytes_out=float(totals["out"][node]),
            by_family={f: (float(b["in"][node]), float(b["out"][node]))
                       for f, b in families.items()}))
    memory_model = simulator.memory
    pools = memory_model.pool_bytes(memory_model.strategy_columns(strategy))[0]
    memory = [PoolMemory(p.name, p.devices, float(b),
                         None if math.isinf(p.capacity_bytes) else float(p.capacity_bytes))
              for p, b in zip(memory_model.pools, pools)]
    return links, memory, simulator.batch_size, float(prediction.step_time_s[0])


# --------------------------------------------------------------- formatting
def short_device(device: str) -> str:
    """"/job:worker/task:0/device:CPU:0" -> "worker:0 CPU:0"."""
    try:
        return DeviceName.parse(device).short
    except DeviceNameError:
        return device


def _save(fig: Figure, path: str | os.PathLike | None) -> Figure:
    if path is not None:
        fig.savefig(os.fspath(path), dpi=110)
    return fig


# ------------------------------------------------------------------ drawing
def plot_strategy(strategy: Strategy, graph_item: GraphItem | None = None,
                  resource_spec: ResourceSpec | None = None, *,
                  path: str | os.PathLike | None = None, batch_size: int | None = None,
                  max_variables: int = 40, layout: StrategyLayout | None = None) -> Figure:
    """Draws a strategy: per device the variables and shards it holds, and the traffic.

    Left: one column per device, one row per variable; a square where the
    device holds the variable (a parameter server's one copy, or every
    replica's mirrored copy), coloured by the synchronizer (PS sync /
    stale / async, all-reduce, all-gather), "k/n" on a shard of a split
    variable. Row labels name each variable, its bytes and synchronizer;
    column labels each device and, with the workload, its memory pool's
    bytes. Right (with a GraphItem and a ResourceSpec): bytes in and out of
    each node's link per step, stacked by synchronizer, as the search's
    simulator counts them, with the time at the link's bandwidth.

    Args:
        strategy: The strategy to draw.
        graph_item, resource_spec: The workload (both or neither; without
            them no bytes are drawn).
        path: Save the figure there (PNG, SVG, PDF: by the suffix).
        batch_size: The global batch the bytes are counted at.
        max_variables: Most variable rows drawn (the largest, with a GraphItem;
            the figure says how many are left out).
        layout: A precomputed `strategy_layout` (its arguments are ignored then).

    Returns:
        The matplotlib Figure.

    Raises:
        MissingExtraError: matplotlib is not installed.
        StrategyError: The strategy does not fit the GraphItem or cluster.
    """
    figure_class = require_matplotlib()
    if max_variables < 1:
        raise InvalidArgumentError(f"max_variables must be >= 1. Received: {max_variables!r}")
    if layout is None:
        layout = strategy_layout(strategy, graph_item, resource_spec, batch_size=batch_size)
    var_bytes = _variable_bytes(layout)
    variables, left_out = _drawn_variables(layout, var_bytes, max_variables)
    devices = layout.devices
    row_of = {v: i for i, v in enumerate(variables)}
    col_of = {d: j for j, d in enumerate(devices)}

    has_links = layout.links is not None
    width = max(6.0, 1.1 * len(devices) + 4.5) + (5.0 if has_links else 0.0)
    height = max(3.5, 0.32 * len(variables) + 2.6)
    fig = figure_class(figsize=(min(width, 28.0), min(height, 24.0)), layout="constrained")
    if has_links:
        grid = fig.add_gridspec(1, 2, width_ratios=(max(2.0, len(devices) * 0.9 + 3), 4))
        ax = fig.add_subplot(grid[0, 0])
        link_ax = fig.add_subplot(grid[0, 1])
    else:
        ax, link_ax = fig.add_subplot(1, 1, 1), None
    ax.set_gid("holdings")

    drawn = [h for h in layout.holdings if h.variable in row_of]
    for family, color in list(SYNC_COLORS.items()):
        points = [h for h in drawn if h.family == family]
        if not points:
            continue
        ax.scatter([col_of[h.device] for h in points], [row_of[h.variable] for h in points],
                   marker="s", s=260, color=color, label=family, zorder=3,
                   edgecolors=["black" if h.role == "ps" else color for h in points])
    for h in drawn:
        if h.num_shards > 1:
            ax.annotate(f"{h.shard + 1}/{h.num_shards}", (col_of[h.device], row_of[h.variable]),
                        ha="center", va="center", fontsize=6, color="white", zorder=4)
    ax.set_xticks(range(len(devices)))
    memory = {d: p for p in (layout.memory or []) for d in p.devices}
    ax.set_xticklabels([short_device(d) + (f"\n{format_bytes(memory[d].nbytes)}"
                                           if d in memory else "") for d in devices],
                       rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(variables)))
    ax.set_yticklabels([_row_label(v, layout.families[v], var_bytes.get(v)) for v in variables],
                       fontsize=7)
    ax.set_xlim(-0.6, len(devices) - 0.4)
    ax.set_ylim(len(variables) - 0.5, -0.5)
    ax.grid(alpha=0.25)
    ax.set_axisbelow(True)
    title = f"strategy {layout.strategy_id[:8]}" + (f" ({layout.origin})" if layout.origin
                                                     else "")
    fig.suptitle(title, fontsize=10)
    ax.set_title("who holds what" + (f" ({left_out} smaller variables not drawn)"
                                     if left_out else ""), fontsize=9, loc="left")
    ax.set_xlabel("device" + (" and its memory pool's bytes" if layout.memory else "")
                  + " (outlined: parameter server)", fontsize=8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False,
              title="synchronizer", title_fontsize=7, markerscale=0.6)
    if link_ax is not None:
        _draw_links(link_ax, layout)
    else:
        fig.text(0.99, 0.01, "bytes per link: pass the GraphItem and ResourceSpec",
                 ha="right", fontsize=7, color="dimgray")
    return _save(fig, path)


def _drawn_variables(layout: StrategyLayout, var_bytes: dict[str, float],
                     max_variables: int) -> tuple[list[str], int]:
    """The variables drawn (the largest `max_variables` when bytes are known, else the
    first), in the layout's order, and how many are left out."""
    variables = list(layout.variables)
    if len(variables) <= max_variables:
        return variables, 0
    keep = set(sorted(variables, key=lambda v: -var_bytes.get(v, 0.0))[:max_variables]
               if var_bytes else variables[:max_variables])
    return [v for v in variables if v in keep], len(variables) - len(keep)


def _variable_bytes(layout: StrategyLayout) -> dict[str, float]:
    """Variable -> its bytes (a sum over its distinct shards), when known."""
    shards: dict[tuple[str, int], float] = {}
    for h in layout.holdings:
        if h.nbytes is not None:
            shards[(h.variable, h.shard)] = h.nbytes
    out: dict[str, float] = {}
    for (name, _), nbytes in shards.items():
        out[name] = out.get(name, 0.0) + nbytes
    return out


def _row_label(variable: str, family: str, nbytes: float | None) -> str:
    size = f", {format_bytes(nbytes)}" if nbytes is not None else ""
    name = variable if len(variable) <= 40 else "…" + variable[-39:]
    return f"{name} ({family}{size})"


def _draw_links(ax, layout: StrategyLayout) -> None:
    links = layout.links or []
    ax.set_gid("links")
    families = [f for f in (*SYNC_COLORS, "mixed")
                if any(f in link.by_family for link in links)]
    xs = range(len(links))
    for offset, direction, index in ((-0.2, "in", 0), (0.2, "out", 1)):
        bottom = [0.0] * len(links)
        for family in families:
            values = [link.by_family.get(family, (0.0, 0.0))[index] for link in links]
            ax.bar([x + offset for x in xs], values, 0.38, bottom=bottom,
                   color=SYNC_COLORS.get(family, "tab:gray"),
                   hatch="//" if direction == "out" else None, edgecolor="white",
                   label=f"{family} {direction}")
            bottom = [b + v for b, v in zip(bottom, values)]
    top = max((max(link.bytes_in, link.bytes_out) for link in links), default=0.0)
    for x, link in zip(xs, links):
        ax.annotate(_duration(link.seconds), (x, max(link.bytes_in, link.bytes_out)),
                    xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                    fontsize=7)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{link.task}\n{link.bandwidth_gbps:g} Gbit/s" for link in links],
                       fontsize=8)
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
    ax.yaxis.set_major_formatter(lambda value, _: format_bytes(value))
    ax.set_ylabel("bytes per step: in (plain), out (hatched)", fontsize=8)
    ax.set_title("bytes per step per link", fontsize=9, loc="left")
    step = (f", predicted step {_duration(layout.predicted_step_time_s)}"
            if layout.predicted_step_time_s else "")
    ax.set_xlabel(f"node (above: its link's time per step)\nthe search's simulator at batch "
                  f"{layout.batch_size}{step}", fontsize=7)
    ax.grid(axis="y", alpha=0.25)
    ax.set_axisbelow(True)
    ax.tick_params(axis="y", labelsize=7)
    if "mixed" in families:   # the holdings' legend names the other colours
        handles = [h for h, label in zip(*ax.get_legend_handles_labels())
                   if label == "mixed in"]
        ax.legend(handles, ["variables split between PS and all-reduce"], fontsize=6,
                  frameon=False, loc="upper left")


def _duration(seconds: float) -> str:
    """Seconds in a readable unit: "9.22 µs", "2.8 ms", "1.2 s"."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


# ------------------------------------------------------------- scaling curve
def scaling_samples(curve: ScalingCurve | ScalingResult | Mapping[int, Any]
                    ) -> dict[int, list[float]]:
    """Workers -> every measured throughput (examples/s), ascending by size.

    Args:
        curve: An autoscaler `ScalingCurve`, a `ScalingResult` (its curve),
            or a mapping of workers to one throughput or a list of them.
    """
    curve = getattr(curve, "curve", curve)
    samples: dict[int, list[float]] = {}
    if hasattr(curve, "observations"):
        for observation in curve.observations():
            samples.setdefault(int(observation.workers), []).append(float(observation.throughput))
    elif isinstance(curve, Mapping):
        for workers, values in curve.items():
            values = list(values) if isinstance(values, (list, tuple)) else [values]
            samples[int(workers)] = [float(v) for v in values]
    else:
        raise InvalidArgumentError(f"a scaling curve is a ScalingCurve, a ScalingResult or a "
                                   f"mapping of workers to examples/s. Received: {curve!r}")
    for workers, values in samples.items():
        if workers < 1 or not values or not all(math.isfinite(v) and v >= 0 for v in values):
            raise InvalidArgumentError(f"throughput at {workers} workers must be finite and "
                                       f">= 0 examples/s. Received: {values!r}")
    return dict(sorted(samples.items()))


def plot_scaling_curve(curve: ScalingCurve | ScalingResult | Mapping[int, Any], *,
                       predicted: Mapping[int, float] | None = None,
                       chosen: int | None = None,
                       trials: Sequence[Any] | None = None, title: str = "",
                       path: str | os.PathLike | None = None) -> Figure:
    """Draws the autoscaler's measured scaling curve: examples/s against workers.

    Every measurement is a dot, the median per size a line (what the
    autoscaler's heuristics decide on), with linear scaling from the
    smallest measured size dashed for reference; optionally the predicted
    curve, the chosen size, and an online search's trials numbered in the
    order they were made.

    Args:
        curve: A `ScalingCurve`, a `ScalingResult` (its curve, chosen size
            and trials are used unless given), or {workers: examples/s or
            [examples/s, ...]}.
        predicted: {workers: predicted examples/s} (e.g. from
            `autoscaler.simulator_predictor`).
        chosen: The size chosen (marked).
        trials: Measurements in order: objects with `workers` and
            `throughput` (the autoscaler's `ScalingTrial`) or (workers, throughput)
            pairs.
        title: The figure's title.
        path: Save the figure there.

    Returns:
        The matplotlib Figure.

    Raises:
        MissingExtraError: matplotlib is not installed.
        InvalidArgumentError: The curve holds no measurement or a bad one.
    """
    figure_class = require_matplotlib()
    if hasattr(curve, "curve") and hasattr(curve, "workers"):   # a ScalingResult
        chosen = curve.workers if chosen is None else chosen
        trials = curve.trials if trials is None else trials
    samples = scaling_samples(curve)
    if not samples:
        raise InvalidArgumentError("the scaling curve holds no measurement to draw")
    sizes = list(samples)
    medians = [statistics.median(samples[n]) for n in sizes]
    fig = figure_class(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    ax.set_gid("scaling")
    dots = [(n, v) for n in sizes for v in samples[n]]
    ax.scatter([n for n, _ in dots], [v for _, v in dots], color="tab:blue", alpha=0.45, s=18,
               label="measured", zorder=3)
    ax.plot(sizes, medians, "-o", color="tab:blue", label="measured median", zorder=4)
    base = sizes[0]
    ideal = [medians[0] * n / base for n in sizes]
    ax.plot(sizes, ideal, "--", color="gray", label=f"linear from {base} worker"
            + ("s" if base > 1 else ""), zorder=2)
    if predicted:
        pairs = sorted((int(n), float(t)) for n, t in predicted.items())
        ax.plot([n for n, _ in pairs], [t for _, t in pairs], ":s", color="tab:orange",
                label="predicted", zorder=3)
    if trials:
        for k, trial in enumerate(trials, start=1):
            workers, value = ((trial.workers, trial.throughput) if hasattr(trial, "workers")
                              else trial)
            ax.annotate(str(k), (workers, value), xytext=(5, 5), textcoords="offset points",
                        fontsize=7, color="tab:red")
        ax.plot([], [], " ", label="1, 2, ...: trials in order")
    if chosen is not None:
        ax.axvline(chosen, color="tab:green", alpha=0.6, label=f"chosen: {chosen}")
    ax.set_xticks(sorted(set(sizes) | ({int(n) for n in predicted} if predicted else set())))
    ax.set_xlabel("workers")
    ax.set_ylabel("examples/s")
    # Linear scaling is a reference: it may leave the frame, the measurements may not.
    shown = [v for _, v in dots] + (list(predicted.values()) if predicted else [])
    ax.set_ylim(0, 1.15 * max(shown) if max(shown) > 0 else 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "measured scaling curve", fontsize=10)
    return _save(fig, path)
