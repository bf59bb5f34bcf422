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
with the simulator. A second rule (`autodist.bench.measured_search_rule`)
decides what orders the candidates a measured search measures: the learned
kind whose pick after k = 2..8 measured trials is never slower than the
simulator's and faster on average is trained on every trial and written to
`autodist/search/data/measured_search_model.txt` (else that file is
removed). The residual model is also evaluated on the simulator calibrated
per cluster shape (`--calibrations`, from `benchmarks/calibrated_simulator.py`).
The tables go to `benchmarks/results/cost_model.md`. The
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
from autodist.bench.measured_search_rule import (MEASURED_TRIALS, by_shape,
                                                 choose_measured_search)
from autodist.bench.trials import Rows, read_records, rescore
from autodist.search.metrics import SIGNIFICANT

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_DATABASE = "benchmarks/data/trials_runtime_2026_12_07.jsonl"
DEFAULT_OUT = "autodist/search/data/cost_model.txt"
DEFAULT_MEASURED_OUT = "autodist/search/data/measured_search_model.txt"
DEFAULT_REPORT = "benchmarks/results/cost_model.md"
DEFAULT_CALIBRATIONS = "benchmarks/results/calibrated_simulator.json"
NO_REFIT = "pretrained model's top k (no refit: the tuner refits from 8 trials)"


def workload_shapes(rows: Rows) -> dict[str, str]:
    """Each workload's cluster shape ("<workers>x<ps>@<Mbit/s>")."""
    return {w: str(r.extra.get("shape", "?")) for w, r in zip(rows.workloads, rows.records)}


def held_out_table(results, ok: int) -> list[str]:
    """The leave-one-model-out table: a row per held-out model, and the means."""
    who = "reg / rank / resid / sim"
    lines = [f"| held-out model | trials | pairwise acc. ({who}) | pairs >10% ({who}) | "
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
    return lines


def importance_line(importance: dict[str, float]) -> str:
    """The shipped model's ten most important features by gain."""
    top = sorted(importance.items(), key=lambda kv: -kv[1])[:10]
    total = sum(importance.values()) or 1.0
    return ("Features of the shipped model by gain (top 10): "
            + ", ".join(f"`{k}` {v / total:.0%}" for k, v in top) + ".")


def measured_search_section(first: dict[str, dict[str, list[float]]], rows: Rows,
                            measured: tuple[str, str, dict[str, float] | None]) -> list[str]:
    """The second rule: what orders the measured search's candidates, with its evidence."""
    decision, why, importance = measured
    ks = list(MEASURED_TRIALS)
    span = f"k = {ks[0]}..{ks[-1]}"
    columns = list(LEARNED) + ["simulator"]
    shape_of = workload_shapes(rows)
    lines = ["## The measured search's ranking (second rule)", "",
             "`optimize(measure=True, trials=k)` and `autodist search --trials k` measure the "
             "candidates in a model's order and keep the fastest measured, so what counts "
             f"there is the pick after k trials (the table above, no refit), for {span}.", "",
             f"Per cluster shape, mean over {span} of the geometric-mean slowdown "
             f"({' / '.join(columns)}):", "",
             "| cluster shape | workloads | " + " | ".join(columns) + " |",
             "|---|---:|" + "---:|" * len(columns)]
    shapes = by_shape(first, shape_of, ks)
    for shape, values in shapes.items():
        count = list(shape_of.values()).count(shape)
        lines.append(f"| {shape} | {count} | "
                     + " | ".join(f"{values[c]:.3f}" for c in columns) + " |")
    lines += ["", "Per workload, the pick after k trials against the simulator's (better / "
              f"equal / worse, over the {len(first['simulator'])} workloads): "]
    for kind in LEARNED:
        counts = []
        for k in (2, 4, 8):
            signs = [int(np.sign(round(first[kind][w][k] - s[k], 9)))
                     for w, s in first["simulator"].items()]
            counts.append(f"k = {k} {signs.count(-1)} / {signs.count(0)} / {signs.count(1)}")
        lines[-1] += f"{kind} {', '.join(counts)}; "
    lines[-1] = lines[-1].rstrip("; ") + "."
    worst = {kind: max(first[kind].items(), key=lambda kv: kv[1][ks[-1]] / first[
        "simulator"][kv[0]][ks[-1]]) for kind in LEARNED}
    model_of = dict(zip(rows.workloads, rows.models))
    lines += ["", f"The workload where each learned kind does worst against the simulator at "
              f"k = {ks[-1]}: " + "; ".join(
                  f"{kind} on {model_of.get(w, '?')} at {shape_of.get(w, '?')} "
                  f"{v[ks[-1]]:.3f} vs {first['simulator'][w][ks[-1]]:.3f}"
                  for kind, (w, v) in worst.items()) + ".", ""]
    text = ("ship the " + decision + " as the measured-search model "
            "(`autodist/search/data/measured_search_model.txt`)" if decision != "simulator"
            else "ship none (the simulator orders the measured candidates)")
    lines += [f"**Measured-search decision: {text}.** Second rule, ordering the candidates "
              f"a measured search measures: {why}. Without trials (k = 0) the first rule "
              "decides.", ""]
    if importance:
        lines += [importance_line(importance), ""]
    return lines


def calibrated_section(results, shots, rows_cal: Rows,
                       default_first: dict[str, dict[str, list[float]]]) -> list[str]:
    """The models retrained on the calibrated simulator's features."""
    first = shots[NO_REFIT]
    columns = list(LEARNED) + ["simulator"]
    means = {c: geometric_means(first[c]) for c in columns}
    ratio = np.array([t / s for t, s in zip(rows_cal.times, rows_cal.simulator) if s > 0])
    lines = ["## On the calibrated simulator", "",
             "Each trial scored again with its cluster shape's calibration measured on the "
             "emulated cluster (`benchmarks/results/calibrated_simulator.json`, from "
             "`benchmarks/calibrated_simulator.py`): every feature and the simulator's seconds "
             "change, so all three learned kinds are retrained; the residual model now learns "
             "log(measured / calibrated simulation). Measured / predicted step time is "
             f"{np.median(ratio):.2f}× in the median (median |log| "
             f"{np.median(np.abs(np.log(ratio))):.3f}). Leave-one-model-out as above:", ""]
    lines += held_out_table(results, len(rows_cal.records)) + ["",
             "The tuner's use (no refit; slowdown of the pick after k trials, geometric mean; "
             "the default-constant residual and simulator beside):", "",
             "| k | " + " | ".join(f"{c} (cal.)" for c in columns)
             + " | residual (default) | simulator (default) |",
             "|---:|" + "---:|" * (len(columns) + 2)]
    default = {c: geometric_means(default_first[c]) for c in ("residual", "simulator")}
    for k in range(len(means["simulator"])):
        lines.append(f"| {k} | " + " | ".join(f"{means[c][k]:.3f}" for c in columns)
                     + f" | {default['residual'][k]:.3f} | {default['simulator'][k]:.3f} |")
    shape_of = workload_shapes(rows_cal)
    shapes = first_choices_by_shape(first, shape_of)
    lines += ["", "First choices (k = 0) per cluster shape on the calibrated simulator "
              f"({' / '.join(columns)}): " + "; ".join(
                  f"{shape} " + " / ".join(f"{v[c]:.3f}" for c in columns)
                  for shape, v in shapes.items()) + ".", "",
              "These models are reported, not shipped: `optimize` scores with the default "
              "constants unless given `calibration=`, and a model ships only for the features "
              "it is used with.", ""]
    return lines


def report(results, rows: Rows, records: Sequence[Any], skipped: int, decision: str,
           why: str, importance: dict[str, float] | None, args, command: str,
           shots: dict[str, dict[str, dict[str, list[float]]]],
           measured_rule: tuple[str, str, dict[str, float] | None],
           calibrated: tuple[Any, Any, Rows] | None) -> str:
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
    lines += held_out_table(results, ok) + [""] + few_shot_section(shots, rows)
    lines += ["", f"**Decision: {decision}.** First rule, ranking unmeasured picks "
              f"(`optimize()`, `autodist search` without trials): {why}.", ""]
    if importance:
        lines += [importance_line(importance), ""]
    lines += measured_search_section(shots[NO_REFIT], rows, measured_rule)
    if calibrated is not None:
        lines += calibrated_section(*calibrated, shots[NO_REFIT])
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


def calibrated_results(raw: Sequence[Any], args) -> tuple[Any, Any, Rows]:
    """Leave-one-model-out and few-shot results on the calibrated simulator's features."""
    import json

    from autodist.search.features import FEATURE_NAMES
    from autodist.search.simulator import Calibration

    with open(args.calibrations, encoding="utf-8") as f:
        calibrations = {shape: Calibration.from_dict(entry["calibration"],
                                                     source=args.calibrations)
                        for shape, entry in json.load(f).items()}
    records = rescore(raw, lambda r: calibrations[r.extra["shape"]], same_flops=False)
    rows = Rows(records, FEATURE_NAMES)
    results = leave_one_model_out(rows, FEATURE_NAMES, seed=args.seed)
    shots = {NO_REFIT: few_shot(rows, refit_min_trials=args.few_shot_trials + 1,
                                seed=args.seed, max_trials=args.few_shot_trials)}
    return results, shots, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database", default=DEFAULT_DATABASE)
    parser.add_argument("--out", default=DEFAULT_OUT, help="the shipped model file")
    parser.add_argument("--measured-out", default=DEFAULT_MEASURED_OUT,
                        help="the shipped measured-search model file")
    parser.add_argument("--calibrations", default=DEFAULT_CALIBRATIONS,
                        help="per cluster shape, the simulator's calibration (JSON of "
                             "benchmarks/calibrated_simulator.py); '' skips that evaluation")
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
    raw = records
    if not args.stored_features:
        records = rescore(records, same_flops=False)
    rows = Rows(records, FEATURE_NAMES)
    if len(set(rows.models)) < 2:
        print(f"need trials of at least 2 models for leave-one-model-out; "
              f"{args.database} has {sorted(set(rows.models))}", file=sys.stderr)
        return 1
    results = leave_one_model_out(rows, FEATURE_NAMES, seed=args.seed)
    shots = {NO_REFIT:
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
    measured_kind, measured_why = choose_measured_search(shots[NO_REFIT])
    measured_out = pathlib.Path(args.measured_out)
    measured_importance = None
    if measured_kind == "simulator":
        if measured_out.exists():
            measured_out.unlink()
            print(f"removed {measured_out}: the simulator orders measured candidates better",
                  file=sys.stderr)
    else:
        model = CostModel(measured_kind, seed=args.seed).fit(rows.X, rows.times, rows.workloads,
                                                             FEATURE_NAMES)
        model.annotate(shipped_because=measured_why.split("; ship when")[0]
                       + " (benchmarks/results/cost_model.md)")
        measured_out.parent.mkdir(parents=True, exist_ok=True)
        model.save(measured_out)
        measured_importance = model.feature_importance()
        print(f"wrote {measured_out} ({measured_kind}, {len(rows.times)} rows)", file=sys.stderr)
    calibrated = None
    if args.calibrations:
        calibrated = calibrated_results(raw, args)
    command = "python benchmarks/train_cost_model.py " + shlex.join(sys.argv[1:])
    text = report(results, rows, records, skipped, f"ship the {decision}"
                  if decision != "simulator" else "ship nothing (the simulator ranks)", why,
                  importance, args, command.strip(), shots,
                  (measured_kind, measured_why, measured_importance), calibrated)
    pathlib.Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.report).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
