"""Trial data set: measure strategies sampled from the search space, write Database records.

Run inside a private network namespace as root (it shapes `lo` with `tc`):

    unshare -n bash -c 'ip link set lo up && python benchmarks/collect_trials.py'

For every model and cluster shape (a workload) it takes the builders'
strategies and strategies sampled from the search space (seeded; half with
the knowledge prior, half uniform), drops duplicates (same candidate in the
space), and measures them on an emulated cluster (`emulated_cluster.py`:
local task processes, one htb cap per task on `lo`). Many strategies share
one cluster launch: `fit(..., switch_at={step: strategy})` switches the
running job in place, so trial k owns steps [k * (warmup + steps), (k + 1) *
(warmup + steps)) of the launch and its first `warmup` steps (the first
steps of a new program are slow) are not timed. If a launch fails, its
strategies are measured again in halves, down to one strategy per launch; a
strategy that still fails becomes a record with its `error`. Each record
holds the strategy, its features, the simulator's prediction and the command
line (`extra`). Extending the data set is running this again with another
`--seed` and `--append`; strategies the database already holds for a
workload and batch size are skipped.

Shapes are "<workers>x<ps>@<Mbit/s>", e.g. "2x1@100": 2 workers + 1 PS task,
every task's link capped at 100 Mbit/s.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import sys
import time
from typing import Any, Callable, Sequence

from emulated_cluster import capped_spec, clear_lo, in_private_netns

# The emulated bench's models and sizes (a measured trial takes seconds on 2 cores).
from autodist.bench.emulated import MODELS

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

DEFAULT_SHAPES = "2x1@100,2x2@1000,3x1@10000"
DEFAULT_DATABASE = "benchmarks/data/trials.jsonl"


@dataclasses.dataclass(frozen=True)
class Shape:
    """An emulated cluster: worker and PS tasks, every task's link capped at `mbit`."""

    workers: int
    ps: int
    mbit: float

    @classmethod
    def parse(cls, text: str) -> Shape:
        """Reads "<workers>x<ps>@<Mbit/s>", e.g. "2x1@100"."""
        try:
            tasks, mbit = text.split("@")
            workers, ps = tasks.lower().split("x")
            shape = cls(int(workers), int(ps), float(mbit))
        except ValueError:
            raise ValueError(f"a shape is '<workers>x<ps>@<Mbit/s>', e.g. '2x1@100'. "
                             f"Received: {text!r}") from None
        if shape.workers < 1 or shape.ps < 0 or shape.mbit <= 0:
            raise ValueError(f"a shape needs >= 1 worker, >= 0 PS and a positive bandwidth. "
                             f"Received: {text!r}")
        return shape

    def __str__(self) -> str:
        return f"{self.workers}x{self.ps}@{self.mbit:g}"


@dataclasses.dataclass
class Outcome:
    """What measuring one strategy gave: timed steps, or an error."""

    step_times_s: list[float] = dataclasses.field(default_factory=list)
    warmup_times_s: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None
    # Seconds the switch into this strategy took (None: it started the launch).
    switch_s: float | None = None
    # Strategies measured in the same launch (1 after a fallback to single launches).
    launch_size: int = 0


# ------------------------------------------------------------------ pure parts
def trial_starts(num_strategies: int, warmup: int, steps: int) -> list[int]:
    """The global step at which each strategy of a launch starts."""
    if num_strategies < 1 or warmup < 0 or steps < 1:
        raise ValueError(f"need >= 1 strategy, warmup >= 0 and steps >= 1. Received: "
                         f"{num_strategies}, {warmup}, {steps}")
    return [k * (warmup + steps) for k in range(num_strategies)]


def switch_schedule(strategies: Sequence[Any], warmup: int, steps: int
                    ) -> tuple[Any, dict[int, Any], int]:
    """The launch's first strategy, its `switch_at` and its total steps."""
    starts = trial_starts(len(strategies), warmup, steps)
    switch_at = {start: s for start, s in zip(starts[1:], strategies[1:])}
    return strategies[0], switch_at, len(strategies) * (warmup + steps)


def slice_step_times(step_times: Sequence[float], num_strategies: int, warmup: int,
                     steps: int) -> list[tuple[list[float], list[float]]]:
    """Per strategy of a launch: (its warm-up step times, its timed step times).

    Raises:
        ValueError: The launch recorded fewer steps than its strategies need.
    """
    starts = trial_starts(num_strategies, warmup, steps)
    need = starts[-1] + warmup + steps
    if len(step_times) < need:
        raise ValueError(f"the launch recorded {len(step_times)} step times; its "
                         f"{num_strategies} strategies of {warmup} + {steps} steps need {need}")
    return [([float(t) for t in step_times[s:s + warmup]],
             [float(t) for t in step_times[s + warmup:s + warmup + steps]]) for s in starts]


def switch_seconds(resizes: Sequence[dict], num_strategies: int, warmup: int,
                   steps: int) -> list[float | None]:
    """Per strategy, how long the switch into it took (None for the first).

    Raises:
        ValueError: A switch is missing or happened at another step than planned.
    """
    starts = trial_starts(num_strategies, warmup, steps)
    by_step = {int(r["step"]): float(r["seconds"]) for r in resizes}
    missing = [s for s in starts[1:] if s not in by_step]
    if missing:
        raise ValueError(f"the launch did not switch at steps {missing} "
                         f"(switches at {sorted(by_step)})")
    return [None] + [by_step[s] for s in starts[1:]]


def measure_with_fallback(strategies: Sequence[Any],
                          launch: Callable[[Sequence[Any]], list[Outcome]],
                          log: Callable[[str], None] = lambda _: None) -> list[Outcome]:
    """Measures strategies in one launch; on failure, in halves, down to one per launch.

    Args:
        strategies: What to measure, in order.
        launch: Measures a list of strategies in one launch (one `Outcome` per
            strategy) or raises when the launch fails.
        log: Receives a line per failed launch.

    Returns:
        One Outcome per strategy, in order; a strategy that fails on its own
        gets `error` (never an exception).
    """
    if not strategies:
        return []
    try:
        outcomes = launch(strategies)
        if len(outcomes) != len(strategies):
            raise RuntimeError(f"the launch returned {len(outcomes)} outcomes for "
                               f"{len(strategies)} strategies")
        return outcomes
    except Exception as e:  # pylint: disable=broad-except
        error = f"{type(e).__name__}: {e}"
        log(f"launch of {len(strategies)} failed: {error.splitlines()[0][:200]}")
        if len(strategies) == 1:
            return [Outcome(error=error, launch_size=1)]
    half = len(strategies) // 2
    return (measure_with_fallback(strategies[:half], launch, log)
            + measure_with_fallback(strategies[half:], launch, log))


def chunks(items: Sequence[Any], size: int) -> list[list[Any]]:
    """`items` in consecutive lists of at most `size` (sizes balanced)."""
    if size < 1:
        raise ValueError(f"size must be >= 1. Received: {size}")
    if not items:
        return []
    count = -(-len(items) // size)
    base, extra = divmod(len(items), count)
    out, start = [], 0
    for i in range(count):
        end = start + base + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def make_record(graph_item, spec, strategy, outcome: Outcome, *, model_key: str,
                batch_size: int, features: dict[str, float] | None,
                predicted_s: float | None, extra: dict[str, Any]):
    """The Database record of one measured (or failed) strategy."""
    from autodist.search.database import TrialRecord, summarize_graph_item  # noqa: PLC0415

    summary = dict(summarize_graph_item(graph_item), batch_size=float(batch_size))
    details = dict(extra, warmup_step_times_s=outcome.warmup_times_s,
                   launch_size=outcome.launch_size)
    if outcome.switch_s is not None:
        details["switch_s"] = outcome.switch_s
    return TrialRecord.from_trial(
        graph_item, spec, strategy, model_name=model_key,
        step_times_s=outcome.step_times_s if outcome.error is None else (),
        error=outcome.error, features=features, predicted_step_time_s=predicted_s,
        graph_summary=summary, extra=details)


def record_key(record) -> tuple[str, float]:
    """The ranking group of a record: its workload and global batch size."""
    return record.workload, float(record.graph_summary.get("batch_size", 0.0))


# ------------------------------------------------------------ the cluster part
def candidate_strategies(graph_item, spec, space, count: int, seed: int,
                         skip: set[tuple[int, ...]] = frozenset()):
    """The builders' strategies, then seeded samples of the space, without duplicates.

    Returns:
        [(origin, strategy, key)], at most `count` (the builders always,
        unless already in `skip`); the key is `space.encode(strategy)` as a
        tuple, which identifies a strategy.
    """
    import numpy as np  # pylint: disable=import-outside-toplevel

    from autodist.search import builders  # pylint: disable=import-outside-toplevel

    out, seen = [], set(skip)
    for name, cls in builders.BUILDERS.items():
        try:
            strategy = cls().build(graph_item, spec)
        except Exception:  # pylint: disable=broad-except
            continue   # e.g. a PS builder without PS tasks
        key = tuple(int(c) for c in space.encode(strategy))
        if key not in seen:
            seen.add(key)
            out.append((name, strategy, key))
    rng = np.random.default_rng(seed)
    for _round in range(20):
        if len(out) >= count:
            break
        need = count - len(out)
        samples = np.concatenate([space.sample(need, rng, prior="knowledge"),
                                  space.sample(need, rng, prior="uniform")])
        rng.shuffle(samples)
        for candidate in samples:
            if len(out) >= count:
                break
            strategy = space.decode(candidate, origin="sample")
            # Keyed by the strategy's own encoding: candidates that differ only in
            # how fusion slots are numbered decode to the same strategy.
            key = tuple(int(c) for c in space.encode(strategy))
            if key in seen:
                continue
            seen.add(key)
            out.append(("sample", strategy, key))
    return out


def measured_keys(records, workload: str, batch_size: int, space) -> set[tuple[int, ...]]:
    """Candidates the database already holds for this workload and batch size."""
    keys = set()
    for record in records:
        if record_key(record) != (workload, float(batch_size)) or not record.strategy:
            continue
        keys.add(tuple(int(c) for c in space.encode(record.load_strategy())))
    return keys


def make_launcher(model, graph_item, spec, x, y, batch_size: int, warmup: int, steps: int,
                  timeout_s: float):
    """A `launch` for `measure_with_fallback`: one cluster, strategies switched in place."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    import autodist  # pylint: disable=import-outside-toplevel

    def launch(strategies):
        first, switch_at, total = switch_schedule(strategies, warmup, steps)
        weights = [np.array(w) for w in model.get_weights()]
        rows = total * batch_size
        xs = [a[:rows] for a in x] if isinstance(x, list) else x[:rows]
        try:
            run = autodist.distribute(model, first, spec, graph_item=graph_item,
                                      step_timeout_s=60, startup_timeout_s=120)
            history = run.fit(xs, y[:rows], batch_size=batch_size, epochs=1,
                              steps_per_epoch=total, verbose=0, shuffle=False,
                              timeout_s=timeout_s, switch_at=switch_at or None)
        finally:
            model.set_weights(weights)   # every launch starts from the same weights
        parts = slice_step_times(history.step_times, len(strategies), warmup, steps)
        switches = switch_seconds(history.resizes, len(strategies), warmup, steps)
        return [Outcome(step_times_s=timed, warmup_times_s=warm, switch_s=sw,
                        launch_size=len(strategies))
                for (warm, timed), sw in zip(parts, switches)]

    return launch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from {sorted(MODELS)}")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="comma-separated '<workers>x<ps>@<Mbit/s>'")
    parser.add_argument("--strategies", type=int, default=40,
                        help="strategies per workload (builders included)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per strategy")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps after each switch (>= 2)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--per-launch", type=int, default=20,
                        help="strategies measured in one cluster launch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--database", default=DEFAULT_DATABASE)
    parser.add_argument("--append", action="store_true",
                        help="add to an existing database (else it must not exist)")
    parser.add_argument("--timeout", type=float, default=1200.0,
                        help="bound on one launch, seconds")
    args = parser.parse_args()
    if not in_private_netns():
        print("run me inside `unshare -n` (see the docstring)", file=sys.stderr)
        return 2
    model_keys = args.models.split(",")
    unknown = [m for m in model_keys if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {sorted(MODELS)}")
    shapes = [Shape.parse(s) for s in args.shapes.split(",")]
    if args.warmup < 2:
        parser.error(f"--warmup must be >= 2 (a new program's first step is slow). "
                     f"Received: {args.warmup}")
    if os.path.exists(args.database) and os.path.getsize(args.database) and not args.append:
        parser.error(f"{args.database} exists; pass --append to extend it")

    import autodist  # pylint: disable=import-outside-toplevel
    from autodist import models  # pylint: disable=import-outside-toplevel
    from autodist.search.database import Database  # pylint: disable=C0415
    from autodist.search.features import featurize_strategy  # pylint: disable=C0415
    from autodist.search.simulator import Simulator  # pylint: disable=C0415
    from autodist.search.space import SearchSpace  # pylint: disable=C0415

    database = Database(args.database)
    existing = database.records() if args.append else []
    command = "python benchmarks/collect_trials.py " + shlex.join(sys.argv[1:])
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    totals = {"ok": 0, "failed": 0}
    start_all = time.perf_counter()
    try:
        for model_key in model_keys:
            kwargs = dict(MODELS[model_key])
            model = models.build(kwargs.pop("name"), **kwargs)
            graph_item = autodist.capture(model)
            for shape in shapes:
                spec, _ = capped_spec(shape.workers, shape.ps, shape.mbit)
                space = SearchSpace(graph_item, spec)
                simulator = Simulator(space, None, batch_size=args.batch_size)
                workload = f"{graph_item.fingerprint}:{spec.fingerprint}"
                skip = measured_keys(existing, workload, args.batch_size, space)
                todo = candidate_strategies(graph_item, spec, space, args.strategies,
                                            seed=args.seed, skip=skip)
                log(f"== {model_key} on {shape}: {len(todo)} strategies "
                    f"({len(skip)} already in the database)")
                longest = min(args.per_launch, max(1, len(todo)))
                x, y = models.synthetic_data(
                    model, longest * (args.warmup + args.steps) * args.batch_size,
                    seed=args.seed)
                launch = make_launcher(model, graph_item, spec, x, y, args.batch_size,
                                       args.warmup, args.steps, args.timeout)
                for group in chunks(todo, args.per_launch):
                    started = time.perf_counter()
                    outcomes = measure_with_fallback([s for _, s, _ in group], launch, log)
                    records = []
                    for (origin, strategy, _key), outcome in zip(group, outcomes):
                        features = featurize_strategy(simulator, strategy)
                        predicted = float(simulator.predict_strategy(strategy).step_time_s[0])
                        extra = {"command": command, "shape": str(shape),
                                 "warmup_steps": args.warmup, "steps": args.steps,
                                 "seed": args.seed, "host": platform.node(),
                                 "cores": os.cpu_count(), "model_kwargs": kwargs,
                                 "builder": origin if origin != "sample" else None}
                        records.append(make_record(
                            graph_item, spec, strategy, outcome, model_key=model_key,
                            batch_size=args.batch_size, features=features,
                            predicted_s=predicted, extra=extra))
                    database.extend(records)
                    ok = sum(r.ok for r in records)
                    totals["ok"] += ok
                    totals["failed"] += len(records) - ok
                    medians = sorted(r.median_step_time_s * 1e3 for r in records if r.ok)
                    span = f"{medians[0]:.1f}-{medians[-1]:.1f} ms" if medians else "-"
                    log(f"   {len(records)} trials in {time.perf_counter() - started:.0f}s: "
                        f"{ok} ok ({span}), {len(records) - ok} failed; total "
                        f"{totals['ok']} ok, {totals['failed']} failed, "
                        f"{time.perf_counter() - start_all:.0f}s")
    finally:
        clear_lo()
    print(f"wrote {totals['ok']} ok and {totals['failed']} failed trials to {args.database}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
