"""Runs a target's cases in worker processes and classifies every case.

A worker that dies (a segfault or abort in C++) or stops making progress (a
hang) fails the case it was on; the harness records it, saves the input and
starts a new worker after it. Every case ends in one of:

    valid, named                          -- fine
    other, oversize, slow, crash, hang    -- failures

Measure from the command line (prints the counts per target):

    python -m tests.fuzz.harness --cases 10000 [--seed 0] [TARGET ...]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
FAILURES = ("other", "oversize", "slow", "crash", "hang")


@dataclasses.dataclass
class Report:
    """What one target's run found."""

    target: str
    cases: int
    counts: collections.Counter
    # (index, outcome, detail) of every failing case.
    failures: list[tuple[int, str, str]]
    # A few messages of the named error, to judge them.
    samples: list[str]
    longest_message: int
    slowest_case_s: float
    seconds: float
    workers: int
    # CPU seconds of the workers that finished (setup included).
    cpu_seconds: float = 0.0
    saved: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        counts = ", ".join(f"{k} {self.counts.get(k, 0)}" for k in ("valid", "named") + FAILURES
                           if self.counts.get(k, 0) or k in ("valid", "named", "other"))
        return (f"{self.target}: {self.cases} mutations: {counts}; longest message "
                f"{self.longest_message} chars, slowest case {self.slowest_case_s:.2f}s, "
                f"{self.seconds:.1f}s ({self.cpu_seconds:.1f}s CPU) in {self.workers} "
                "worker(s)")

    def describe_failures(self, limit: int = 10) -> str:
        lines = [self.summary()]
        for index, outcome, detail in self.failures[:limit]:
            lines.append(f"  case {index}: {outcome}: {detail[:600]}")
        if self.saved:
            lines.append(f"  inputs saved under: {', '.join(self.saved[:limit])}")
        return "\n".join(lines)


def _worker(target: str, seed: int, start: int, stop: int, out: pathlib.Path,
            env: dict[str, str]) -> subprocess.Popen:
    # stderr goes to a file: a pipe nobody reads fills up and stalls the worker.
    with open(f"{out}.stderr", "wb") as err:
        return subprocess.Popen([sys.executable, "-m", "tests.fuzz.case_worker", target, str(seed),
                                 str(start), str(stop), str(out)],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)


def _stderr(out: pathlib.Path) -> str:
    try:
        with open(f"{out}.stderr", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - 2000, 0))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _lines(out: pathlib.Path) -> list[str]:
    try:
        text = out.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [line for line in text.split("\n")[:-1]]   # only complete lines


def _stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


def dump_case(target: str, seed: int, index: int, directory: pathlib.Path,
              env: dict[str, str]) -> str:
    """Writes the input of one case (regenerated in a fresh worker) under `directory`."""
    path = directory / f"{target}-seed{seed}-case{index}"
    subprocess.run([sys.executable, "-m", "tests.fuzz.case_worker", target, str(seed), "--dump",
                    str(index), str(path)], cwd=REPO, env=env, timeout=300, check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return str(path)


def run(target: str, cases: int, seed: int = 0, *, hang_s: float = 30.0,
        setup_s: float = 180.0, artifacts: pathlib.Path | None = None,
        max_failures: int = 50) -> Report:
    """Runs cases 0..cases-1 of `target`; failing inputs go under `artifacts`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    counts: collections.Counter = collections.Counter()
    failures: list[tuple[int, str, str]] = []
    samples: list[str] = []
    longest = 0
    slowest = 0.0
    workers = 0
    cpu = 0.0
    began = time.monotonic()
    start = 0
    with tempfile.TemporaryDirectory(prefix="fuzz-harness-") as tmp:
        while start < cases and len(failures) < max_failures:
            out = pathlib.Path(tmp) / f"out-{start}"
            process = _worker(target, seed, start, cases, out, env)
            workers += 1
            last_growth, size, ready, dead = time.monotonic(), -1, False, ""
            while True:
                try:
                    process.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    pass
                now_size = out.stat().st_size if out.exists() else 0
                if now_size != size:
                    size, last_growth = now_size, time.monotonic()
                    ready = ready or now_size > 0
                limit = hang_s if ready else setup_s
                if time.monotonic() - last_growth > limit:
                    dead = "hang" if ready else "hang in setup"
                    _stop(process)
                    break
            stderr = _stderr(out)
            lines = _lines(out)
            if not lines or lines[0] != "ready":
                raise RuntimeError(f"fuzz worker for {target} failed in setup "
                                   f"({dead or f'exit {process.returncode}'}):\n{stderr}")
            done = lines[-1].startswith("done")
            if done:
                cpu += float(lines[-1].split("\t")[1])
            next_index = start
            for line in lines[1:]:
                if line.startswith("done"):
                    continue
                index, outcome, seconds, length, detail = line.split("\t", 4)
                index = int(index)
                counts[outcome] += 1
                longest = max(longest, int(length))
                slowest = max(slowest, float(seconds))
                if outcome in FAILURES:
                    failures.append((index, outcome, detail))
                elif outcome == "named" and len(samples) < 8 and detail not in samples:
                    samples.append(detail)
                next_index = index + 1
            if done:
                break
            if "the fuzzer failed to make case" in stderr:
                raise RuntimeError(f"fuzz worker for {target} failed:\n{stderr}")
            how = dead or (f"crash (signal {-process.returncode})" if process.returncode < 0
                           else f"crash (exit {process.returncode})")
            counts["hang" if dead else "crash"] += 1
            failures.append((next_index, "hang" if dead else "crash", f"{how}: {stderr[-600:]}"))
            start = next_index + 1
    report = Report(target, cases, counts, failures, samples, longest, slowest,
                    time.monotonic() - began, workers, cpu)
    if artifacts is not None:
        artifacts.mkdir(parents=True, exist_ok=True)
        report.saved = [dump_case(target, seed, index, artifacts, env)
                        for index, _, _ in failures[:10]]
    return report


def _kind(detail: str) -> str:
    """The exception line of a failure's detail (tracebacks come with escaped newlines)."""
    lines = [line for line in detail.replace("\\n", "\n").splitlines() if line.strip()]
    return lines[-1].strip()[:150] if lines else ""


def main() -> int:
    from tests.fuzz.targets import TARGETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("targets", nargs="*", default=list(TARGETS))
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--artifacts", type=pathlib.Path, default=None)
    parser.add_argument("--max-failures", type=int, default=1_000_000)
    parser.add_argument("--hang-s", type=float, default=30.0)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    bad = 0
    for name in args.targets:
        report = run(name, args.cases, args.seed, artifacts=args.artifacts,
                     max_failures=args.max_failures, hang_s=args.hang_s)
        print(report.describe_failures(5) if report.failures else report.summary(), flush=True)
        if args.verbose:
            for sample in report.samples:
                print("   ", sample[:300])
        kinds = collections.Counter(f"{outcome}: {_kind(detail)}"
                                    for _, outcome, detail in report.failures)
        for kind, n in kinds.most_common(12):
            print(f"    {n:6d} x {kind}")
        bad += bool(report.failures)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
