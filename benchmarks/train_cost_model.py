"""Trains the shipped cost model on the trial data set and reports its held-out ranking.

    python benchmarks/train_cost_model.py

Reads the trial database (`benchmarks/collect_trials.py` writes it; a
`.jsonl.gz` file is read as well), scores each trial's strategy again with
the current simulator and features (`--stored-features` keeps the stored
ones), turns every successful trial into a row
(its features in `FEATURE_NAMES` order, its median step time, its ranking
group: workload and global batch size) and evaluates leave-one-model-out:
for each model, a LightGBM regressor and ranker are trained on the other
models' trials and rank the held-out model's strategies, next to the
analytic simulator alone (its prediction is stored in every record). Per
held-out model it reports pairwise accuracy (pairs of one workload ordered
as measured), pairwise accuracy on the pairs whose times differ by more
than 10% (the rest are within the measurement noise), Kendall's tau (mean
over workloads), and the top-1 slowdown: measured time of the strategy
ranked first over the best measured time, geometric mean over workloads.

The better learned kind (mean pairwise accuracy over held-out models) is
trained on every trial and written to `autodist/search/data/cost_model.txt`
when it ranks held-out models at least about as well as the simulator
(`--margin`) and its top-1 slowdown is no worse (what `optimize` trains is
the strategy ranked first); otherwise nothing is shipped (and an old shipped file is
removed), so `autodist.optimize` ranks with the simulator. The tables go to
`benchmarks/results/cost_model.md`.
"""
from __future__ import annotations

import argparse
import gzip
import math
import os
import pathlib
import platform
import shlex
import sys
import time
from typing import Any, Sequence

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_DATABASE = "benchmarks/data/trials.jsonl"
DEFAULT_OUT = "autodist/search/data/cost_model.txt"
DEFAULT_REPORT = "benchmarks/results/cost_model.md"
PREDICTORS = ("regressor", "ranker", "simulator")
# Pairs whose measured times differ by less than this factor are within the noise.
SIGNIFICANT = 1.10


def read_records(path: str | os.PathLike) -> tuple[list[Any], int]:
    """The valid records of a trial database (plain or gzip-compressed JSON Lines).

    Returns:
        (records, number of skipped lines).
    """
    from autodist.search.database import Database, DatabaseError, decode_line  # noqa: PLC0415

    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no trial database at {str(path)!r}; run "
                                "benchmarks/collect_trials.py first")
    if path.suffix != ".gz":
        contents = Database(path).read()
        return contents.records, len(contents.skipped)
    records, skipped = [], 0
    with gzip.open(path, "rb") as f:
        for line in f.read().split(b"\n"):
            if not line.strip():
                continue
            try:
                records.append(decode_line(line))
            except DatabaseError:
                skipped += 1
    return records, skipped


class Rows:
    """The training rows of the successful trials of a database."""

    def __init__(self, records: Sequence[Any], feature_names: Sequence[str]) -> None:
        usable = [r for r in records if r.ok and r.features]
        missing = sorted({n for r in usable for n in feature_names if n not in r.features})
        if missing:
            raise ValueError(f"trial records lack features {missing}; recollect them with "
                             "the current autodist")
        self.records = usable
        self.X = np.array([[r.features[n] for n in feature_names] for r in usable])
        self.times = np.array([r.median_step_time_s for r in usable])
        # Rankings compare strategies of one workload at one global batch size.
        self.workloads = [f"{r.workload}@{r.graph_summary.get('batch_size', 0):g}"
                          for r in usable]
        self.models = [r.model_name for r in usable]
        self.simulator = np.array([r.predicted_step_time_s if r.predicted_step_time_s
                                   is not None else r.features["sim_step_time_s"]
                                   for r in usable])


def rescore(records: Sequence[Any]) -> list[Any]:
    """The records with features and simulator predictions of the current code.

    A trial's measured times do not change when the simulator or the features
    do, but what a cost model learns from must be what `optimize` computes
    now; each successful record's strategy is scored again on its workload
    (the model rebuilt from `model_name` and `extra["model_kwargs"]`, the
    stored resource spec, the stored global batch).
    """
    import dataclasses  # pylint: disable=import-outside-toplevel

    import keras  # pylint: disable=import-outside-toplevel

    from autodist import models  # pylint: disable=import-outside-toplevel
    from autodist.ir.capture import capture  # pylint: disable=import-outside-toplevel
    from autodist.search.features import featurize_strategy  # pylint: disable=C0415
    from autodist.search.simulator import Simulator  # pylint: disable=C0415
    from autodist.search.space import SearchSpace  # pylint: disable=C0415

    graph_items: dict[str, Any] = {}
    simulators: dict[tuple[str, str, float], Any] = {}
    out = []
    for record in records:
        if not record.ok:
            out.append(record)
            continue
        kwargs = dict(record.extra.get("model_kwargs", {}))
        key = f"{record.model_name}:{sorted(kwargs.items())}"
        if key not in graph_items:
            keras.backend.clear_session()  # layer names as in a fresh process
            graph_items[key] = capture(models.build(record.model_name, **kwargs))
        graph_item = graph_items[key]
        if graph_item.fingerprint != record.graph_item_fingerprint and \
                not _same_graph(graph_item, record):
            raise ValueError(f"{record.model_name} {kwargs} captures to another graph "
                             f"({graph_item.fingerprint}) than its trials "
                             f"({record.graph_item_fingerprint}); use --stored-features")
        batch = float(record.graph_summary.get("batch_size", 0)) or None
        sim_key = (key, record.resource_spec_fingerprint, batch or 0.0)
        if sim_key not in simulators:
            spec = record.load_resource_spec()
            simulators[sim_key] = Simulator(SearchSpace(graph_item, spec), None,
                                            batch_size=int(batch) if batch else None)
        features = featurize_strategy(simulators[sim_key], record.load_strategy())
        out.append(dataclasses.replace(record, features=features,
                                       predicted_step_time_s=features["sim_step_time_s"]))
    return out


def _same_graph(graph_item, record) -> bool:
    """Whether a capture has the trial's variables, ops and FLOPs.

    The fingerprint also covers the capture's per-op estimates (e.g. the rows
    of a sparse gradient), which a newer capture may compute differently for
    the same graph; the trial's measurements still hold then.
    """
    from autodist.search.database import summarize_graph_item  # pylint: disable=C0415

    now = summarize_graph_item(graph_item)
    return all(abs(now[k] - float(record.graph_summary.get(k, -1.0))) <= 1e-9 * max(1.0, now[k])
               for k in now)


def significant_pairwise_accuracy(pred: np.ndarray, actual: np.ndarray,
                                  workloads: Sequence[str],
                                  factor: float = SIGNIFICANT) -> float:
    """Pairwise accuracy over the within-workload pairs whose times differ by > `factor`."""
    correct = total = 0.0
    for idx in _groups(workloads):
        p, a = pred[idx], actual[idx]
        ratio = a[:, None] / a[None, :]
        valid = ratio > factor                       # i clearly slower than j
        total += valid.sum()
        correct += (valid & (p[:, None] > p[None, :])).sum() \
            + 0.5 * (valid & (p[:, None] == p[None, :])).sum()
    return float(correct / total) if total else float("nan")


def top1_slowdown(pred: np.ndarray, actual: np.ndarray, workloads: Sequence[str]) -> float:
    """Geometric mean over workloads of (measured time of the top-ranked) / (best measured)."""
    logs = [math.log(actual[idx][np.argmin(pred[idx])] / actual[idx].min())
            for idx in _groups(workloads)]
    return float(math.exp(np.mean(logs))) if logs else float("nan")


def _groups(names: Sequence[str]) -> list[np.ndarray]:
    out: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        out.setdefault(name, []).append(i)
    return [np.array(v) for v in out.values()]


def metrics(pred: np.ndarray, actual: np.ndarray, workloads: Sequence[str]) -> dict[str, float]:
    """The ranking metrics of the report for one set of predictions."""
    from autodist.search.cost_model import kendall_tau, pairwise_accuracy  # noqa: PLC0415

    return {"pairwise": pairwise_accuracy(pred, actual, workloads),
            "pairwise_10pct": significant_pairwise_accuracy(pred, actual, workloads),
            "tau": kendall_tau(pred, actual, workloads),
            "top1": top1_slowdown(pred, actual, workloads)}


def leave_one_model_out(rows: Rows, feature_names: Sequence[str], seed: int = 0
                        ) -> dict[str, dict[str, dict[str, float]]]:
    """Held-out metrics per model: {model: {predictor: metrics}}."""
    from autodist.search.cost_model import CostModel  # pylint: disable=import-outside-toplevel

    models = np.array(rows.models, dtype=object)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for model in dict.fromkeys(rows.models):
        test, train = models == model, models != model
        train_workloads = [w for w, t in zip(rows.workloads, train) if t]
        test_workloads = [w for w, t in zip(rows.workloads, test) if t]
        out[model] = {}
        for kind in ("regressor", "ranker"):
            fitted = CostModel(kind, seed=seed).fit(rows.X[train], rows.times[train],
                                                    train_workloads, feature_names)
            out[model][kind] = metrics(fitted.predict(rows.X[test]), rows.times[test],
                                       test_workloads)
        out[model]["simulator"] = metrics(rows.simulator[test], rows.times[test],
                                          test_workloads)
        out[model]["simulator"]["rows"] = float(test.sum())
        out[model]["simulator"]["workloads"] = float(len(set(test_workloads)))
    return out


def mean_over_models(results: dict[str, dict[str, dict[str, float]]], predictor: str,
                     metric: str) -> float:
    values = [r[predictor][metric] for r in results.values()
              if math.isfinite(r[predictor][metric])]
    return float(np.mean(values)) if values else float("nan")


def choose(results: dict[str, dict[str, dict[str, float]]], margin: float) -> tuple[str, str]:
    """(the kind to ship or "simulator", why).

    A learned kind ships when its mean held-out pairwise accuracy is at
    least the simulator's minus `margin` and its mean top-1 slowdown is no
    worse than the simulator's: `optimize` without measurements trains the
    strategy ranked first, so a better overall order that picks slower
    strategies does not help users. Of the kinds that qualify, the one with
    the better pairwise accuracy ships.
    """
    sim = mean_over_models(results, "simulator", "pairwise")
    sim_top1 = mean_over_models(results, "simulator", "top1")
    scores = {k: (mean_over_models(results, k, "pairwise"), mean_over_models(results, k, "top1"))
              for k in ("regressor", "ranker")}
    rule = (f"ship when at least the simulator's pairwise accuracy minus {margin:g} and a "
            "top-1 slowdown no worse than its")
    qualified = [k for k, (pairwise, top1) in scores.items()
                 if pairwise >= sim - margin and not top1 > sim_top1]
    if qualified:
        best = max(qualified, key=lambda k: scores[k][0])
        return best, (f"the {best} ranks held-out models with mean pairwise accuracy "
                      f"{scores[best][0]:.3f} and top-1 slowdown {scores[best][1]:.2f}, against "
                      f"the simulator's {sim:.3f} and {sim_top1:.2f} ({rule})")
    found = ", ".join(f"{k} {p:.3f} / {t:.2f}" for k, (p, t) in scores.items())
    return "simulator", (f"no learned model ranks held-out models about as well as the "
                         f"simulator (pairwise accuracy / top-1 slowdown: {found}; simulator "
                         f"{sim:.3f} / {sim_top1:.2f}; {rule}): nothing shipped, the "
                         "simulator ranks")


def report(results, rows: Rows, records: Sequence[Any], skipped: int, decision: str,
           why: str, importance: dict[str, float] | None, args, command: str) -> str:
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
        "Each held-out model's strategies are ranked by a LightGBM regressor and ranker "
        "trained on the other models' trials, and by the analytic simulator alone (no "
        "training). Metrics within each workload (model × shape × batch): pairwise accuracy "
        "(all pairs; a tie in the prediction counts half), pairwise accuracy on the pairs "
        f"whose measured times differ by more than {round((SIGNIFICANT - 1) * 100)}% (the "
        "rest are within the noise of 5 timed steps on a 2-core machine), Kendall's "
        "τ-b (mean over workloads) and the top-1 slowdown (measured time of the strategy "
        "ranked first / best measured time; geometric mean over workloads, 1.00 = "
        "perfect).", ""]
    lines += ["| held-out model | trials | pairwise acc. (reg / rank / sim) | "
              "pairs >10% (reg / rank / sim) | Kendall τ (reg / rank / sim) | "
              "top-1 slowdown (reg / rank / sim) |", "|---|---:|---|---|---|---|"]

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
    lines += ["", f"**Decision: {decision}.** {why[0].upper() + why[1:]}.", ""]
    if importance:
        top = sorted(importance.items(), key=lambda kv: -kv[1])[:10]
        total = sum(importance.values()) or 1.0
        lines += ["Features of the shipped model by gain (top 10): "
                  + ", ".join(f"`{k}` {v / total:.0%}" for k, v in top) + ".", ""]
    measured = [r for r in rows.records if r.extra.get("steps")]
    if measured:
        setup = sorted({(int(r.graph_summary.get("batch_size", 0)), r.extra["warmup_steps"],
                         r.extra["steps"]) for r in measured})
        ratio = np.array([r.median_step_time_s / r.predicted_step_time_s for r in measured
                          if r.predicted_step_time_s])
        lines += ["Measurement: " + "; ".join(f"global batch {b}, {s} timed steps after {w} "
                                                f"warm-up steps per strategy"
                                                for b, w, s in setup)
                  + ", several strategies per cluster launch (switched in place). The "
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stored-features", action="store_true",
                        help="learn from the features stored in the records instead of "
                             "scoring each trial's strategy again with the current simulator")
    args = parser.parse_args()

    from autodist.search.cost_model import CostModel  # pylint: disable=C0415
    from autodist.search.features import FEATURE_NAMES  # pylint: disable=C0415

    records, skipped = read_records(args.database)
    if not args.stored_features:
        records = rescore(records)
    rows = Rows(records, FEATURE_NAMES)
    if len(set(rows.models)) < 2:
        print(f"need trials of at least 2 models for leave-one-model-out; "
              f"{args.database} has {sorted(set(rows.models))}", file=sys.stderr)
        return 1
    results = leave_one_model_out(rows, FEATURE_NAMES, seed=args.seed)
    decision, why = choose(results, args.margin)
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
                  importance, args, command.strip())
    pathlib.Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.report).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
