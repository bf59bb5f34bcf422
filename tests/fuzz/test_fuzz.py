"""Every reader of a file format survives mutated input (see tests/fuzz/harness.py).

Per format, 10,000 mutations (bit flips, truncation, inserted and deleted
bytes, splices of extreme tokens, fields set to NaN, inf, -1, 2^31, huge
strings, deep nesting, unknown enum numbers, alias bombs) of a few valid
files, with a fixed seed. Each must read as a valid object or raise the
format's named error with a message of at most 4096 characters, within 5 s;
any other exception, a crash (segfault, abort), a hang or a slow case fails,
and its input is saved for reproduction. Readers that call into C++
(LightGBM, TensorFlow's checkpoint reader) are what the worker processes are
for: a crash kills a worker, not pytest.

Environment: AUTODIST_FUZZ_CASES (default 10000), AUTODIST_FUZZ_SEED (default 0).
"""
from __future__ import annotations

import concurrent.futures
import os

import pytest

from tests.fuzz import harness
from tests.fuzz.targets import TARGETS

CASES = int(os.environ.get("AUTODIST_FUZZ_CASES", "10000"))
SEED = int(os.environ.get("AUTODIST_FUZZ_SEED", "0"))
# Two targets at a time: one per core of a CI machine.
PARALLEL = 2


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, harness.Report]:
    artifacts = tmp_path_factory.mktemp("fuzz-failures")
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        futures = {name: pool.submit(harness.run, name, CASES, SEED, artifacts=artifacts)
                   for name in TARGETS}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("target", list(TARGETS))
def test_reader_survives_mutations(reports, target):
    report = reports[target]
    print(report.summary())
    assert not report.failures, report.describe_failures()
    assert report.counts["valid"] + report.counts["named"] == CASES
    # The mutations reach the reader's validation, not only its first checks.
    assert report.counts["valid"] > 0 and report.counts["named"] > 0


def test_the_harness_catches_crashes_hangs_and_stray_exceptions(tmp_path):
    from tests.fuzz.mutations import case_rng

    rolls = [case_rng("selftest", 0, i).randrange(10) for i in range(30)]
    report = harness.run("selftest", 30, 0, hang_s=3, artifacts=tmp_path)
    expected = {3: "crash", 5: "hang", 7: "other", 8: "oversize"}
    assert [(i, o) for i, o, _ in report.failures] == \
        [(i, expected[r]) for i, r in enumerate(rolls) if r in expected]
    assert "signal 6" in next(d for _, o, d in report.failures if o == "crash")
    assert report.counts["valid"] + report.counts["named"] == \
        sum(1 for r in rolls if r not in expected)
    assert report.saved and all(os.path.isdir(p) for p in report.saved)
