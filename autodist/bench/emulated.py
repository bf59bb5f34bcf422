"""Strategies vs baselines on an emulated cluster with capped links.

For each model and bandwidth, side by side: every builder and `optimize`'s
pick (all in one cluster launch, measured by the search's local runner,
`autodist.runtime.local_runner.LocalRunner`: `fit(..., switch_at=...)` switches
the running job from one strategy to the next; the first `warmup` steps
after a switch are not timed), single-device Keras (one process, the same global
batch) and a `MultiWorkerMirroredStrategy` custom loop on the workers' capped
ports. Per row: median step time after warm-up with min and max, examples/s,
the simulator's lower bound, and the speed-up over the best baseline.

Models and their sizes come from the example-model registry
(`autodist.models.REGISTRY`, `bench_kwargs`).

The *best baseline* of a model and bandwidth is the fastest (median) of
every builder, MWMS and single-device Keras; `speedup = best baseline
median / row median` (> 1: faster than all baselines; the best baseline
itself has 1.00). `optimize`'s pick is the row being judged.
"""
from __future__ import annotations

import csv
import dataclasses
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Sequence

from autodist.ir.errors import InvalidArgumentError
from autodist.models import BENCH_MODELS

ALL_BUILDERS = ("PS", "PSLoadBalancing", "PartitionedPS", "UnevenPartitionedPS", "AllReduce",
                "PartitionedAR", "RandomAxisPartitionAR", "Parallax")


@dataclasses.dataclass(frozen=True)
class Preset:
    """What one `autodist bench` run measures."""

    models: tuple[str, ...]
    mbits: tuple[float, ...]
    builders: tuple[str, ...] = ALL_BUILDERS
    workers: int = 2
    ps: int = 1
    batch_size: int = 64
    warmup: int = 3
    steps: int = 10
    mwms: bool = True
    # 2: a second launch measures the strategies in reverse order and the timed
    # steps of both are pooled (no strategy is always measured late in a launch).
    orders: int = 2
    # optimize's cost model: None for the shipped default, "simulator", or a path.
    cost_model: str | None = None


PRESETS: dict[str, Preset] = {
    "small": Preset(models=("mlp", "ncf"), mbits=(100.0, 1000.0),
                    builders=("PS", "PartitionedPS", "AllReduce", "Parallax"),
                    warmup=2, steps=6),
    # Builders that coincide are measured once, which leaves time for 20 steps.
    "full": Preset(models=BENCH_MODELS, mbits=(100.0, 1000.0, 10000.0), steps=20),
}

# The systems a row measures.
AUTODIST, OPTIMIZE, MWMS, SINGLE = "autodist", "optimize", "mwms", "single-device"

FIELDS = ("model", "mbit", "workers", "ps", "batch_size", "system", "strategy", "pick_origin",
          "median_ms", "min_ms", "max_ms", "examples_per_s", "lower_bound_ms", "speedup",
          "capped", "error", "command", "host", "date")


@dataclasses.dataclass
class Row:
    """One measured (or failed) strategy or baseline."""

    model: str
    mbit: float
    workers: int
    ps: int
    batch_size: int
    system: str            # autodist (a builder) | optimize | mwms | single-device
    strategy: str          # builder name, "optimize", "MWMS custom loop", "Keras"
    # optimize: the pick's origin; any row: "= <builder>" when its strategy is an
    # earlier builder's (then it repeats that measurement).
    pick_origin: str = ""
    median_ms: float = float("nan")
    min_ms: float = float("nan")
    max_ms: float = float("nan")
    examples_per_s: float = float("nan")
    lower_bound_ms: float = float("nan")
    speedup: float = float("nan")
    capped: bool = True
    error: str = ""
    command: str = ""
    host: str = ""
    date: str = ""

    def set_times(self, step_times_s: Sequence[float]) -> None:
        """Fills median/min/max and throughput from timed step times (seconds)."""
        if not step_times_s:
            raise InvalidArgumentError("no timed steps")
        self.median_ms = statistics.median(step_times_s) * 1e3
        self.min_ms = min(step_times_s) * 1e3
        self.max_ms = max(step_times_s) * 1e3
        self.examples_per_s = self.batch_size / (self.median_ms / 1e3)

    @property
    def ok(self) -> bool:
        """Measured without error."""
        return not self.error and self.median_ms == self.median_ms


# ----------------------------------------------------------------- pure parts
def parse_list(text: str, kind: Callable[[str], Any], what: str) -> tuple:
    """Splits a comma-separated option; names the option in its error."""
    try:
        items = tuple(kind(t.strip()) for t in text.split(",") if t.strip())
    except ValueError:
        raise InvalidArgumentError(f"{what}: cannot read {text!r}") from None
    if not items:
        raise InvalidArgumentError(f"{what}: empty list {text!r}")
    return items


def fill_speedups(rows: list[Row]) -> None:
    """Sets each row's speedup over the best baseline of its model and bandwidth."""
    for key in {(r.model, r.mbit) for r in rows}:
        group = [r for r in rows if (r.model, r.mbit) == key]
        baselines = [r.median_ms for r in group if r.ok and r.system != OPTIMIZE]
        best = min(baselines) if baselines else float("nan")
        for r in group:
            r.speedup = best / r.median_ms if r.ok else float("nan")


def write_csv(rows: Iterable[Row], path: str) -> None:
    """Writes rows as CSV (columns `FIELDS`)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: _fmt_csv(getattr(r, k)) for k in FIELDS})


def _fmt_csv(value: Any) -> Any:
    return f"{value:.4g}" if isinstance(value, float) else value


def read_csv(path: str) -> list[Row]:
    """Reads rows written by `write_csv`."""
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for raw in csv.DictReader(f):
            kwargs: dict[str, Any] = {}
            for field in dataclasses.fields(Row):
                text = raw.get(field.name, "")
                if field.type == "float":
                    kwargs[field.name] = float(text) if text not in ("", None) else float("nan")
                elif field.type == "int":
                    kwargs[field.name] = int(text)
                elif field.type == "bool":
                    kwargs[field.name] = text == "True"
                else:
                    kwargs[field.name] = text or ""
            rows.append(Row(**kwargs))
    return rows


def merge(old: Sequence[Row], new: Sequence[Row]) -> list[Row]:
    """`old` with every (model, bandwidth) that `new` measured replaced by `new`'s rows."""
    replaced = {(r.model, r.mbit) for r in new}
    return [r for r in old if (r.model, r.mbit) not in replaced] + list(new)


def _ms(value: float) -> str:
    return "—" if value != value else (f"{value:.1f}" if value >= 10 else f"{value:.2f}")


def markdown(rows: Sequence[Row], title: str = "Strategies vs baselines, emulated cluster"
             ) -> str:
    """The results as markdown: a summary table, then one table per model and bandwidth."""
    order = {m: i for i, m in enumerate(BENCH_MODELS)}
    keys = sorted({(r.model, r.mbit) for r in rows}, key=lambda k: (order.get(k[0], 99), k[1]))
    lines = [f"# {title}", "",
             "Median ms/step after warm-up (min–max), examples/s, the simulator's lower "
             "bound (compute and bandwidth perfectly overlapped, no latency) and the "
             "speed-up over the best baseline: the fastest of every builder, MWMS and "
             "single-device Keras (speedup = its median / the row's; > 1 is faster). In the "
             "summary, ratios are the other system's ms/step over optimize's pick's (> 1: the "
             "pick is faster).", "",
             *_notes(rows), "", "## Summary", "", summary_table(rows), "",
             "## Every measurement", ""]
    for model, mbit in keys:
        group = sorted((r for r in rows if (r.model, r.mbit) == (model, mbit)),
                       key=lambda r: (not r.ok, r.median_ms))
        first = group[0]
        lines += [f"### {model} at {mbit:g} Mbit/s ({first.workers} workers + {first.ps} PS, "
                  f"global batch {first.batch_size})", "",
                  "| strategy | ms/step median | min–max | examples/s | lower bound ms | "
                  "speedup vs best baseline |", "|---|---:|---:|---:|---:|---:|"]
        for r in group:
            label = {OPTIMIZE: f"**optimize** ({r.pick_origin})", MWMS: "MWMS custom loop",
                     SINGLE: "single-device Keras (1 process)"}.get(
                         r.system, f"{r.strategy} ({r.pick_origin})" if r.pick_origin
                         else r.strategy)
            if r.system == MWMS and not r.capped:
                label += " (uncapped)"
            if not r.ok:
                lines.append(f"| {label} | failed: {r.error[:80]} | | | | |")
                continue
            lines.append(f"| {label} | {_ms(r.median_ms)} | {_ms(r.min_ms)}–{_ms(r.max_ms)} | "
                         f"{r.examples_per_s:.0f} | {_ms(r.lower_bound_ms)} | "
                         f"{r.speedup:.2f} |")
        lines.append("")
    commands = sorted({r.command for r in rows if r.command})
    hosts = sorted({f"{r.host} ({r.date})" for r in rows if r.host})
    lines += ["## Provenance", "", "Commands (each inside `unshare -n bash -c 'ip link set lo "
              "up && ...'` as root):", ""] + [f"    {c}" for c in commands]
    lines += ["", f"Machine and date: {', '.join(hosts)}.", ""]
    return "\n".join(lines)


def _notes(rows: Sequence[Row]) -> list[str]:
    shapes = sorted({(r.workers, r.ps) for r in rows})
    cluster = ", ".join(f"{w} workers + {p} PS" for w, p in shapes)
    hosts = sorted({r.host for r in rows if r.host})
    above = sorted({r.model for r in rows if r.ok and r.lower_bound_ms > r.median_ms},
                   key=lambda m: BENCH_MODELS.index(m) if m in BENCH_MODELS else 99)
    bound_note = ([f"- The simulator's lower bound uses its default (uncalibrated) machine "
                   f"constants; it exceeds measured times for {', '.join(above)}: there its "
                   "compute estimate is too high for this machine."] if above else [])
    return [
        f"- Cluster: {cluster} as local processes on one machine ({', '.join(hosts)}); "
        "each task's link is capped with an htb class on `lo`. Compute is contended: every "
        "task shares the same cores, so a distributed run can at best use the cores one "
        "process could; single-device Keras is one process, no network, the same global "
        "batch. The caps make the communication cost, where strategies differ, visible.",
        "- Builders and optimize's pick share one cluster launch per model and bandwidth "
        "(`fit(switch_at=...)`); the first steps after each switch are not timed. A "
        "second launch measures them in reverse order and the timed steps of both are "
        "pooled, so no strategy is always measured late in a launch (in one-order runs "
        "the same strategy measured twice in a launch differed by 0.83–1.29×). "
        "optimize ranks with its default (the shipped cost model when the package has one, "
        "else the analytic simulator), no measured trials. Each distinct "
        "strategy is measured once: a builder or pick whose strategy equals an earlier "
        "builder's (\"= AllReduce\"; e.g. with one PS every PS builder is plain PS) repeats "
        "that measurement, so the best builder is not the luckiest of several measurements "
        "of one strategy.",
        "- MWMS: `tf.distribute.MultiWorkerMirroredStrategy`, custom loop, one process per "
        "worker on the capped worker ports (the same caps), the same global batch; its lower "
        "bound column repeats AllReduce's.",
        "- `ParameterServerStrategy` is left out: in TF 2.21 it trains only asynchronously, "
        "driven by a `ClusterCoordinator` in a separate coordinator process (Keras 3 `fit` "
        "is unsupported there), so it has no synchronous step time comparable to these rows.",
    ] + bound_note


def summary_table(rows: Sequence[Row]) -> str:
    """One line per model and bandwidth: best builder, optimize's pick, the baselines."""
    order = {m: i for i, m in enumerate(BENCH_MODELS)}
    keys = sorted({(r.model, r.mbit) for r in rows}, key=lambda k: (order.get(k[0], 99), k[1]))
    out = ["| model | Mbit/s | best builder (ms) | optimize's pick (ms) | best builder / "
           "optimize | MWMS (ms) | MWMS / optimize | single-device (ms) | best baseline / "
           "optimize |", "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for model, mbit in keys:
        group = [r for r in rows if (r.model, r.mbit) == (model, mbit) and r.ok]
        builders = [r for r in group if r.system == AUTODIST]
        best = min(builders, key=lambda r: r.median_ms) if builders else None
        pick = next((r for r in group if r.system == OPTIMIZE), None)
        mwms = next((r for r in group if r.system == MWMS), None)
        single = next((r for r in group if r.system == SINGLE), None)
        ratio = (f"{best.median_ms / pick.median_ms:.2f}×" if best and pick else "—")
        out.append(
            f"| {model} | {mbit:g} | "
            + (f"{best.strategy} {_ms(best.median_ms)}" if best else "—") + " | "
            + (f"{pick.pick_origin} {_ms(pick.median_ms)}" if pick else "—") + f" | {ratio} | "
            + (_ms(mwms.median_ms) + ("" if mwms.capped else " (uncapped)") if mwms else "—")
            + " | " + (f"{mwms.median_ms / pick.median_ms:.2f}×" if mwms and pick else "—")
            + " | " + (_ms(single.median_ms) if single else "—") + " | "
            + (f"{pick.speedup:.2f}×" if pick else "—") + " |")
    return "\n".join(out)


def plot(rows: Sequence[Row], path: str, stamp: str = "") -> bool:
    """One panel per bandwidth, grouped bars per model (log ms/step); False without matplotlib.

    A bar is the median step time, its whisker the min–max of the timed steps
    (`Row.min_ms`, `Row.max_ms`), the black tick the simulator's lower bound.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    order = {m: i for i, m in enumerate(BENCH_MODELS)}
    mbits = sorted({r.mbit for r in rows})
    models = sorted({r.model for r in rows}, key=lambda m: order.get(m, 99))
    series = [("best builder", "tab:blue"), ("optimize", "tab:orange"), ("MWMS", "tab:green"),
              ("single-device", "tab:gray")]
    fig, axes = plt.subplots(1, len(mbits), figsize=(4.2 * len(mbits), 4.2), squeeze=False,
                             sharey=True)
    width = 0.8 / len(series)
    for ax, mbit in zip(axes[0], mbits):
        for j, (label, color) in enumerate(series):
            heights, bounds, below, above = [], [], [], []
            for model in models:
                group = [r for r in rows if r.model == model and r.mbit == mbit and r.ok]
                pick = _series_row(group, label)
                heights.append(pick.median_ms if pick else float("nan"))
                bounds.append(pick.lower_bound_ms if pick else float("nan"))
                # Whiskers: min–max of the timed steps (none where unknown).
                below.append(_spread(pick.median_ms - pick.min_ms) if pick else 0.0)
                above.append(_spread(pick.max_ms - pick.median_ms) if pick else 0.0)
            xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(models))]
            ax.bar(xs, heights, width, label=label, color=color, yerr=[below, above],
                   error_kw={"elinewidth": 0.8, "capsize": 2, "ecolor": "black"})
            ax.scatter(xs, bounds, marker="_", color="black", s=60, zorder=3,
                       label="simulator lower bound" if j == 0 else None)
        ax.set_yscale("log")
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models)
        ax.set_title(f"{mbit:g} Mbit/s per task")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("ms/step (log): median, whiskers min–max")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8,
               frameon=False, bbox_to_anchor=(0.5, 0.035))
    if stamp:
        fig.text(0.01, 0.005, stamp, fontsize=6, color="dimgray")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _spread(ms: float) -> float:
    """A whisker's length: 0 where min or max is unknown (NaN) or inconsistent."""
    return ms if ms == ms and ms > 0 else 0.0


def _series_row(group: Sequence[Row], label: str) -> Row | None:
    if label == "best builder":
        builders = [r for r in group if r.system == AUTODIST]
        return min(builders, key=lambda r: r.median_ms) if builders else None
    system = {"optimize": OPTIMIZE, "MWMS": MWMS, "single-device": SINGLE}[label]
    return next((r for r in group if r.system == system), None)


def write_reports(rows: Sequence[Row], out_dir: str, name: str = "emulated") -> list[str]:
    """Writes `<name>.csv`, `<name>.md` and (with matplotlib) `<name>.png` to `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{name}.{ext}") for ext in ("csv", "md", "png")]
    write_csv(rows, paths[0])
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(markdown(rows))
    commands = sorted({r.command for r in rows if r.command})
    stamp = (commands[0] if commands else "") + (
        f" (and {len(commands) - 1} more commands, see {name}.md)" if len(commands) > 1
        else "") + f" — {platform.node()}, {time.strftime('%Y-%m-%d')}"
    if not plot(rows, paths[2], stamp):
        print("autodist bench: matplotlib is not installed; no plot written", file=sys.stderr)
        paths.pop()
    return paths


# -------------------------------------------------------------- the measuring
def measure_single_device(model_name: str, kwargs: dict[str, Any], batch_size: int,
                          warmup: int, steps: int) -> list[float]:
    """Timed step times (s) of plain Keras `train_on_batch` in this process."""
    from autodist import models

    model = models.build(model_name, **kwargs)
    x, y = models.synthetic_data(model, batch_size, seed=1)
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
    return times[warmup:]


def measure_cell(model_key: str, mbit: float, preset: Preset, *, shape: bool = True,
                 command: str = "", log: Callable[[str], None] = lambda _: None,
                 timeout_s: float = 900.0) -> list[Row]:
    """Measures every strategy and baseline of one model at one bandwidth.

    Args:
        model_key: A benchmarked example model (`autodist.models.BENCH_MODELS`).
        mbit: Per-task bandwidth cap, Mbit/s.
        preset: Cluster shape, builders, batch and steps.
        shape: Apply the caps with `tc` (needs root in a private namespace).
        command: The command line stamped on each row.
        log: Receives progress lines.
        timeout_s: Bound on one cluster launch.

    Returns:
        One Row per builder, for `optimize`'s pick, MWMS and single-device
        (failures are rows with `error`, never exceptions).
    """
    from autodist import models
    from autodist.bench.capped_links import capped_spec
    from autodist.ir.capture import capture
    from autodist.search.simulator import Simulator
    from autodist.search.space import SearchSpace

    if model_key not in BENCH_MODELS:
        raise InvalidArgumentError(f"unknown benchmark model {model_key!r}; known: "
                                   f"{sorted(BENCH_MODELS)}")
    stamp = dict(command=command, host=f"{platform.node()} ({os.cpu_count()} cores)",
                 date=time.strftime("%Y-%m-%d"))
    base = dict(model=model_key, mbit=mbit, workers=preset.workers, ps=preset.ps,
                batch_size=preset.batch_size, capped=shape, **stamp)
    model = models.build_bench(model_key)
    graph_item = capture(model)
    spec, ports = capped_spec(preset.workers, preset.ps, mbit, shape=shape)
    space = SearchSpace(graph_item, spec)
    cell = _Cell(graph_item, spec, space, base)
    cell.add_builders(preset.builders)
    cell.add_optimize_pick(model, preset, log=log, label=f"{model_key} @ {mbit:g} Mbit/s")
    cell.predict_lower_bounds(Simulator(space, None, batch_size=preset.batch_size))
    cell.measure(model, preset, timeout_s=timeout_s, log=log)
    rows = [row for row, _ in cell.candidates]
    rows += _baseline_rows(model_key, preset, ports, base, rows)
    fill_speedups(rows)
    for r in rows:
        log(f"  {r.strategy:22s} " + (f"{r.median_ms:8.2f} ms" if r.ok else f"failed: {r.error}"))
    return rows


class _Cell:
    """The strategies of one model at one bandwidth: each builder's and `optimize`'s pick.

    Builders often produce the same strategy (with one PS, every PS builder is
    plain PS). Each distinct strategy is measured once; a twin's row (a later
    builder, or optimize's pick) repeats the first one's measurement and names
    it ("= AllReduce"), so the best builder is not the luckiest of several
    measurements of one strategy.
    """

    def __init__(self, graph_item, spec, space, base: dict[str, Any]) -> None:
        self.graph_item, self.spec, self.space = graph_item, spec, space
        self.base = base
        # Every row with the strategy it measures (None: failed, or a twin's).
        self.candidates: list[tuple[Row, Any]] = []
        # (a twin's row, the row whose measurement it repeats).
        self.twins: list[tuple[Row, Row]] = []
        self._first: dict[tuple[int, ...], Row] = {}

    def _key(self, strategy) -> tuple[int, ...]:
        return tuple(int(c) for c in self.space.encode(strategy))

    def add_builders(self, names: Sequence[str]) -> None:
        """A row per builder; one that fails to build is a row with its error."""
        from autodist.search import builders

        for builder in names:
            row = Row(system=AUTODIST, strategy=builder, **self.base)
            try:
                strategy = builders.get(builder)().build(self.graph_item, self.spec)
            except Exception as e:  # noqa: BLE001 - a builder that fails is a row with its error
                row.error = f"build: {type(e).__name__}: {e}"
                self.candidates.append((row, None))
                continue
            key = self._key(strategy)
            if key in self._first:
                row.pick_origin = f"= {self._first[key].strategy}"
                self.twins.append((row, self._first[key]))
                self.candidates.append((row, None))
            else:
                self._first[key] = row
                self.candidates.append((row, strategy))

    def add_optimize_pick(self, model, preset: Preset, *, log: Callable[[str], None],
                          label: str) -> None:
        """The row of `optimize`'s pick (a builder's twin when it is one)."""
        from autodist import api

        started = time.perf_counter()
        plan = api.optimize(model, self.spec, graph_item=self.graph_item,
                            batch_size=preset.batch_size, cost_model=preset.cost_model)
        twin = self._first.get(self._key(plan.strategy))
        origin = (plan.strategy.origin or "search") + (f" = {twin.strategy}"
                                                        if twin is not None else "")
        log(f"{label}: optimize picked {origin} in {time.perf_counter() - started:.1f}s")
        row = Row(system=OPTIMIZE, strategy="optimize", pick_origin=origin, **self.base)
        if twin is not None:
            self.twins.append((row, twin))
        self.candidates.append((row, None if twin is not None else plan.strategy))

    def predict_lower_bounds(self, simulator) -> None:
        """Each measured strategy's lower bound by the simulator."""
        for row, strategy in self.candidates:
            if strategy is not None:
                row.lower_bound_ms = float(simulator.predict_strategy(strategy)
                                           .lower_bound_s[0]) * 1e3

    def measure(self, model, preset: Preset, *, timeout_s: float,
                log: Callable[[str], None]) -> None:
        """Measures every distinct strategy on the cluster; twins copy their measurement.

        Every strategy in one launch, switched in place; with orders=2 a second
        launch in reverse order, the timed steps of both pooled.
        """
        from autodist.runtime.local_runner import LocalRunner

        todo = [(row, s) for row, s in self.candidates if s is not None]
        runner = LocalRunner(model, self.spec, graph_item=self.graph_item,
                             batch_size=preset.batch_size, steps=preset.steps,
                             warmup_steps=preset.warmup, orders=preset.orders, data_seed=0,
                             timeout_s=timeout_s, log=lambda line: log(f"  {line}"))
        started = time.perf_counter()
        for (row, _), result in zip(todo, runner.run([s for _, s in todo])):
            if result.ok:
                row.set_times(result.step_times_s)
            else:
                row.error = (result.error or "no timed steps").splitlines()[0][:200]
        orders = preset.orders if len(todo) > 1 else 1
        for row, measured in self.twins:
            for field in ("median_ms", "min_ms", "max_ms", "examples_per_s", "lower_bound_ms",
                          "error"):
                setattr(row, field, getattr(measured, field))
        log(f"  {len(todo)} strategies x {orders} orders in "
            f"{time.perf_counter() - started:.0f}s")


def _baseline_rows(model_key: str, preset: Preset, ports: Sequence[int], base: dict[str, Any],
                   strategy_rows: Sequence[Row]) -> list[Row]:
    """The MWMS row (with `preset.mwms`) and the single-device Keras row."""
    from autodist import models
    from autodist.bench.mwms import measure_mwms

    kwargs = models.bench_kwargs(model_key)
    rows = []
    if preset.mwms:
        row = Row(system=MWMS, strategy="MWMS custom loop", **base)
        try:
            row.set_times(measure_mwms(model_key, kwargs, ports[:preset.workers],
                                       steps=preset.steps, warmup=preset.warmup,
                                       batch_size=preset.batch_size))
            row.lower_bound_ms = next((r.lower_bound_ms for r in strategy_rows
                                       if r.strategy == "AllReduce"), float("nan"))
        except Exception as e:  # noqa: BLE001 - a failed baseline is a row with its error
            row.error = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    row = Row(system=SINGLE, strategy="Keras", **dict(base, capped=False))
    try:
        row.set_times(measure_single_device(model_key, kwargs, preset.batch_size, preset.warmup,
                                            preset.steps))
    except Exception as e:  # noqa: BLE001 - a failed baseline is a row with its error
        row.error = f"{type(e).__name__}: {str(e)[:200]}"
    rows.append(row)
    return rows


def run(preset: Preset, out_dir: str, *, command: str, append: bool = False,
        shape: bool = True, log: Callable[[str], None] = lambda _: None) -> list[str]:
    """Measures a preset and writes its reports; returns the written paths.

    With `append`, rows of an existing `<out_dir>/emulated.csv` are kept
    except those of the (model, bandwidth) pairs measured now.
    """
    from autodist.bench.capped_links import clear_lo

    rows: list[Row] = []
    csv_path = os.path.join(out_dir, "emulated.csv")
    old = read_csv(csv_path) if append and os.path.exists(csv_path) else []
    try:
        for model_key in preset.models:
            for mbit in preset.mbits:
                rows += measure_cell(model_key, mbit, preset, shape=shape, command=command,
                                     log=log)
                # Written after every cell: a late failure keeps what was measured.
                write_reports(merge(old, rows), out_dir)
    finally:
        if shape:
            clear_lo()
    return write_reports(merge(old, rows), out_dir)
