"""Trains the shipped cost model on the trial data set and reports its held-out ranking.

    python benchmarks/train_cost_model.py

Reads the trial database (`benchmarks/collect_trials.py` writes it; a
`.jsonl.gz` file is read as well), scores each trial's strategy again with
the current simulator and features (`--stored-features` keeps the stored
ones), turns every successful trial into a row
(its features in `FEATURE_NAMES` order, its median step time, its ranking
group: workload and global batch size) and evaluates leave-one-model-out:
for each model, a LightGBM regressor, ranker and residual model (of the
simulator's error) are trained on the other models' trials and rank the
held-out model's strategies, next to the analytic simulator alone. Per
held-out model it reports pairwise accuracy (pairs of one workload ordered
as measured), pairwise accuracy on the pairs whose times differ by more
than 10% (the rest are within the measurement noise), Kendall's tau (mean
over workloads), and the top-1 slowdown: measured time of the strategy
ranked first over the best measured time, geometric mean over workloads.
It also evaluates the tuner's use (`autodist.bench.shipping.few_shot`): each
pretrained model plus k = 0..8 trials of the held-out workload, measured in
the model's order (without refits, as the tuner's default of refitting from
8 trials gives, and refitted after every trial from 2), against the
simulator's top k and random draws; the pick is the best measured.

The better learned kind (mean pairwise accuracy over held-out models) is
trained on every trial and written to `autodist/search/data/cost_model.txt`
when it ranks held-out models at least about as well as the simulator
(`--margin`), its top-1 slowdown is no worse (what `optimize` trains is
the strategy ranked first), and on no cluster shape are its first choices
slower than the simulator's by more than `--shape-margin` (a mean won on
some shapes and lost on others does not help every user); otherwise nothing
is shipped (and an old shipped file is removed), so `autodist.optimize` ranks
with the simulator. The tables go to `benchmarks/results/cost_model.md`. The
library parts live in the package: `autodist.bench.trials` (reading,
rescoring, rows), `autodist.bench.shipping` (leave-one-model-out, the rule)
and `autodist.search.metrics`.
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import platform
import shlex
import sys
import time
from typing import Any, Sequence

import numpy as np

from autodist.bench.shipping import (LEARNED, PREDICTORS, RANDOM, choose,
                                     first_choices_by_shape, few_shot, geometric_means,
                                     leave_one_model_out, mean_over_models)
from autodist.bench.trials import Rows, read_records, rescore
from autodist.search.metrics import SIGNIFICANT

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_DATABASE = "benchmarks/data/trials.jsonl"
DEFAULT_OUT = "autodist/search/data/cost_model.txt"
DEFAULT_REPORT = "benchmarks/results/cost_model.md"


def workload_shapes(rows: Rows) -> dict[str, str]:
    """Each workload's cluster shape ("<workers>x<ps>@<Mbit/s>")."""
    return {w: str(r.extra.get("shape", "?")) for w, r in zip(rows.workloads, rows.records)}


def report(results, rows: Rows, records: Sequence[Any], skipped: int, decision: str,
           why: str, importance: dict[str, float] | None, args, command: str,
           shots: dict[str, dict[str, dict[str, list[float]]]]) -> str:
    """The Markdown report."""
    ok = len(rows.records)
    failed = sum(1 for r in records if r.error is not None)
    shapes = sorted({r.extra.get("shape", r.resource_spec_fingerprint[:8]) for r in records})
    lines = [
        "# Shipped cost model: leave-one-model-out ranking on the trial data set", "",
        f"Data set `{args.database}`: {len(records)} trials ({ok} ok, {failed} failed"
        f"{f', {skipped} unreadable lines' if skipped else ''}) over "
        f"{len(set(rows.models))} models × {len(shapes)} cluster shapes "
        f"({', '.join(shapes)}; `<workers>x<ps>@<Mbit/s per task>`), "
        f"{len(set(rows.workloads))} workloads. Trials per model: "
        + ", ".join(f"{m} {rows.models.count(m)}" for m in dict.fromkeys(rows.models)) + ".",
        "",
        "Each held-out model's strategies are ranked by three LightGBM models trained on the "
        "other models' trials — a regressor of log step time, a ranker (lambdarank) and a "
        "residual model of the simulator's error (target log(measured / simulated), "
        "prediction simulator × exp(residual)) — and by the analytic simulator alone (no "
        "training). Metrics within each workload (model × shape × batch): pairwise accuracy "
        "(all pairs; a tie in the prediction counts half), pairwise accuracy on the pairs "
        f"whose measured times differ by more than {round((SIGNIFICANT - 1) * 100)}% (the "
        "rest are within the measurement noise, below), Kendall's "
        "τ-b (mean over workloads) and the top-1 slowdown (measured time of the strategy "
        "ranked first / best measured time; geometric mean over workloads, 1.00 = "
        "perfect).", ""]
    who = "reg / rank / resid / sim"
    lines += [f"| held-out model | trials | pairwise acc. ({who}) | pairs >10% ({who}) | "
              f"Kendall τ ({who}) | top-1 slowdown ({who}) |", "|---|---:|---|---|---|---|"]

    def cell(model_results, metric, fmt):
        return " / ".join(_fmt(model_results[p][metric], fmt) for p in PREDICTORS)

    for model, r in results.items():
        lines.append(f"| {model} | {int(r['simulator']['rows'])} | "
                     f"{cell(r, 'pairwise', '{:.3f}')} | {cell(r, 'pairwise_10pct', '{:.3f}')} "
                     f"| {cell(r, 'tau', '{:+.3f}')} | {cell(r, 'top1', '{:.2f}')} |")
    means = {m: " / ".join(_fmt(mean_over_models(results, p, m), f) for p in PREDICTORS)
             for m, f in (("pairwise", "{:.3f}"), ("pairwise_10pct", "{:.3f}"),
                          ("tau", "{:+.3f}"), ("top1", "{:.2f}"))}
    lines.append(f"| **mean over models** | {ok} | {means['pairwise']} | "
                 f"{means['pairwise_10pct']} | {means['tau']} | {means['top1']} |")
    lines += [""] + few_shot_section(shots, rows)
    lines += ["", f"**Decision: {decision}.** {why[0].upper() + why[1:]}.", ""]
    if importance:
        top = sorted(importance.items(), key=lambda kv: -kv[1])[:10]
        total = sum(importance.values()) or 1.0
        lines += ["Features of the shipped model by gain (top 10): "
                  + ", ".join(f"`{k}` {v / total:.0%}" for k, v in top) + ".", ""]
    measured = [r for r in rows.records if r.extra.get("steps")]
    if measured:
        ratio = np.array([r.median_step_time_s / r.predicted_step_time_s for r in measured
                          if r.predicted_step_time_s])
        lines += ["Measurement: " + "; ".join(
            f"{', '.join(shapes)}: global batch {b}, {s} timed steps after {w} warm-up "
            f"steps per strategy in {n} launch{'es' if n > 1 else ''}"
            f"{f' (its record pools the {n * s} timed steps)' if n > 1 else ''}"
            for (b, w, s, n), shapes in measurement_setups(measured).items())
                  + "; several strategies per cluster launch (switched in place). The "
                  "simulator's seconds are uncalibrated here (default constants): measured / "
                  f"predicted step time is {np.median(ratio):.1f}× in the median "
                  f"({np.percentile(ratio, 5):.1f}–{np.percentile(ratio, 95):.1f}× for 90% of "
                  "trials); only its order is compared. The learned models use LightGBM's "
                  "defaults of `CostModel` (not tuned on these held-out results).", ""]
    collect = sorted({r.extra.get("command", "") for r in records} - {""})
    lines += ["## Commands", "",
              "Collect (each in a private network namespace as root: `unshare -n bash -c "
              "'ip link set lo up && ...'`; extend the data set with another `--seed` and "
              "`--append`):", "", "```"] + collect + ["```", "",
              "Evaluate and rebuild the shipped model:", "", "```", command, "```", "",
              f"On {platform.node()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}."]
    return "\n".join(lines) + "\n"


def few_shot_section(shots: dict[str, dict[str, dict[str, list[float]]]],
                     rows: Rows) -> list[str]:
    """The report's tables of `few_shot`: one per refit policy, a row per k."""
    columns = list(LEARNED) + ["simulator", RANDOM]
    any_policy = next(iter(shots.values()))
    workloads = len(any_policy["simulator"])
    lines = ["## The tuner's use: a pretrained model and k measured trials", "",
             f"For each of the {workloads} workloads, each learned model trained on the other "
             "models' trials ranks the workload's measured strategies (its pool of "
             f"{len(rows.times) // max(workloads, 1)}); the strategy it ranks first among the "
             "unmeasured is measured (its recorded time revealed), k times; the pick is the "
             "best measured (k = 0: the first choice, so k = 0 and 1 agree), as the tuner "
             "picks. Slowdown = the pick's time / the pool's best, geometric mean over "
             "workloads (worst workload in brackets). The simulator measures its own top k "
             "(the tuner's baseline: it learns nothing before 8 trials); random is the mean "
             "of 20 random orders. The tuner's split of trials between builders and "
             "searched candidates and its rounds of 2 are not modelled: one trial per round, "
             "candidates from the pool.", ""]
    tables: list[str] = []
    for policy, results in shots.items():
        if results == any_policy and tables:
            lines += [f"**{policy}**: the same table. An `update` on at most 8 trials of "
                      "one workload changes no order here: with `min_data_in_leaf=5` a tree "
                      "needs 10 rows to split, so the refit only adds a constant.", ""]
            continue
        tables.append(policy)
        lines += [f"**{policy}**", "",
                  "| k | " + " | ".join(columns) + " |",
                  "|---:|" + "---:|" * len(columns)]
        means = {c: geometric_means(results[c]) for c in columns}
        worst = {c: np.max(np.array(list(results[c].values())), axis=0) for c in columns}
        for k in range(len(means["simulator"])):
            lines.append(f"| {k} | " + " | ".join(f"{means[c][k]:.3f} ({worst[c][k]:.2f})"
                                                  for c in columns) + " |")
        lines.append("")
    first = any_policy
    lines.append("First choices (k = 0) against the simulator's, per workload: " + "; ".join(
        f"{kind} better in {_count(first, kind, -1)}, equal in {_count(first, kind, 0)}, "
        f"worse in {_count(first, kind, 1)}" for kind in LEARNED) + ".")
    lines.append("")
    shape_of = workload_shapes(rows)
    by_shape = first_choices_by_shape(first, shape_of)
    if len(by_shape) > 1:
        counts = {shape: list(shape_of.values()).count(shape) for shape in by_shape}
        lines.append("First choices (k = 0) per cluster shape, geometric mean over its "
                     f"workloads ({' / '.join(PREDICTORS)}): " + "; ".join(
                         f"{shape} ({counts[shape]} workloads) " + " / ".join(
                             f"{by_shape[shape][p]:.3f}" for p in PREDICTORS)
                         for shape in by_shape) + ".")
        lines.append("")
    noise = []
    for (_b, _w, steps, repeats), shapes in measurement_setups(rows.records).items():
        group = [r for r in rows.records if setup_of(r) == (_b, _w, steps, repeats)]
        cv = [float(np.std(r.step_times_s) / np.median(r.step_times_s)) for r in group
              if len(r.step_times_s) > 1]
        text = (f"{', '.join(shapes)} ({steps} steps × {repeats} launch"
                f"{'es' if repeats > 1 else ''}): steps vary by {np.median(cv):.0%}")
        spread = [(max(m) - min(m)) / float(np.median(r.step_times_s)) for r in group
                  for m in [r.extra.get("launch_medians_s") or []] if len(m) > 1]
        if spread:
            text += (f", a strategy's launch medians differ by {np.median(spread):.0%} "
                     f"(median; {np.percentile(spread, 90):.0%} at the 90th percentile)")
        noise.append(text)
    if noise:
        lines.append("Noise (standard deviation / median of a trial's timed steps, median "
                     "over trials; launch spread = (slowest - fastest launch median) / the "
                     "trial's median): " + "; ".join(noise) + ". A trial's median is "
                     "uncertain by several percent, and many first-choice differences above "
                     "lie within it.")
    return lines


def setup_of(record: Any) -> tuple[int, int, int, int]:
    """A trial's measurement: (global batch, warm-up steps, timed steps, launches)."""
    return (int(record.graph_summary.get("batch_size", 0)),
            int(record.extra.get("warmup_steps", 0)), int(record.extra.get("steps", 0)),
            int(record.extra.get("repeats", 1)))


def measurement_setups(records: Sequence[Any]) -> dict[tuple[int, int, int, int], list[str]]:
    """The measurement setups of the trials, each with its cluster shapes."""
    out: dict[tuple[int, int, int, int], list[str]] = {}
    for record in records:
        shapes = out.setdefault(setup_of(record), [])
        if str(record.extra.get("shape", "?")) not in shapes:
            shapes.append(str(record.extra.get("shape", "?")))
    return dict(sorted(out.items()))


def _count(results: dict[str, dict[str, list[float]]], kind: str, sign: int) -> int:
    """Workloads where `kind`'s first choice is faster (-1), as fast (0), slower (1) than
    the simulator's."""
    return sum(1 for w, s in results[kind].items()
               if int(np.sign(round(s[0] - results["simulator"][w][0], 9))) == sign)


def _fmt(value: float, fmt: str) -> str:
    return fmt.format(value) if math.isfinite(value) else "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database", default=DEFAULT_DATABASE)
    parser.add_argument("--out", default=DEFAULT_OUT, help="the shipped model file")
    parser.add_argument("--report", default=DEFAULT_REPORT)
    parser.add_argument("--margin", type=float, default=0.01,
                        help="ship when the learned model's mean held-out pairwise accuracy "
                             "is at least the simulator's minus this")
    parser.add_argument("--shape-margin", type=float, default=0.01,
                        help="ship only if on no cluster shape the learned model's first "
                             "choices are slower than the simulator's by more than this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--few-shot-trials", type=int, default=8,
                        help="the largest k of the few-shot evaluation")
    parser.add_argument("--stored-features", action="store_true",
                        help="learn from the features stored in the records instead of "
                             "scoring each trial's strategy again with the current simulator")
    args = parser.parse_args()

    from autodist.search.cost_model import CostModel
    from autodist.search.features import FEATURE_NAMES

    records, skipped = read_records(args.database)
    if not args.stored_features:
        records = rescore(records)
    rows = Rows(records, FEATURE_NAMES)
    if len(set(rows.models)) < 2:
        print(f"need trials of at least 2 models for leave-one-model-out; "
              f"{args.database} has {sorted(set(rows.models))}", file=sys.stderr)
        return 1
    results = leave_one_model_out(rows, FEATURE_NAMES, seed=args.seed)
    shots = {"pretrained model's top k (no refit: the tuner refits from 8 trials)":
             few_shot(rows, refit_min_trials=args.few_shot_trials + 1, seed=args.seed,
                      max_trials=args.few_shot_trials),
             "refitted after every trial from 2 (`update`, as `RefitCostModel(min_trials=2)`)":
             few_shot(rows, refit_min_trials=2, seed=args.seed,
                      max_trials=args.few_shot_trials)}
    shape_of = workload_shapes(rows)
    first = next(iter(shots.values()))   # the pretrained models' first choices (k = 0)
    decision, why = choose(results, args.margin, first_choices_by_shape(first, shape_of),
                           args.shape_margin)
    out = pathlib.Path(args.out)
    importance = None
    if decision == "simulator":
        if out.exists():
            out.unlink()
            print(f"removed {out}: the simulator ranks better", file=sys.stderr)
    else:
        model = CostModel(decision, seed=args.seed).fit(rows.X, rows.times, rows.workloads,
                                                        FEATURE_NAMES)
        out.parent.mkdir(parents=True, exist_ok=True)
        model.save(out)
        importance = model.feature_importance()
        print(f"wrote {out} ({decision}, {len(rows.times)} rows)", file=sys.stderr)
    command = "python benchmarks/train_cost_model.py " + shlex.join(sys.argv[1:])
    text = report(results, rows, records, skipped, f"ship the {decision}"
                  if decision != "simulator" else "ship nothing (the simulator ranks)", why,
                  importance, args, command.strip(), shots)
    pathlib.Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.report).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
