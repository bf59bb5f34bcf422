"""`autodist bench`: argument handling, refusal outside a namespace, reports (no cluster)."""
from __future__ import annotations

import math

import pytest

from autodist import cli
from autodist.bench import emulated
from autodist.bench.emulated import MWMS, OPTIMIZE, SINGLE, AUTODIST, Row


def _rows() -> list[Row]:
    base = dict(model="mlp", mbit=100.0, workers=2, ps=1, batch_size=64,
                command="autodist bench --models mlp", host="h (2 cores)", date="2026-01-01")
    rows = []
    for system, strategy, ms in [(AUTODIST, "PS", 40.0), (AUTODIST, "AllReduce", 20.0),
                                 (OPTIMIZE, "optimize", 16.0), (MWMS, "MWMS custom loop", 25.0),
                                 (SINGLE, "Keras", 30.0)]:
        row = Row(system=system, strategy=strategy, lower_bound_ms=5.0, **base)
        row.set_times([ms / 1e3, (ms - 1) / 1e3, (ms + 2) / 1e3])
        rows.append(row)
    rows[2].pick_origin = "search"
    rows.append(Row(system=AUTODIST, strategy="Parallax", error="boom", **base))
    emulated.fill_speedups(rows)
    return rows


def _args(*argv: str):
    args = cli.build_parser().parse_args(["bench", *argv])
    args.argv = list(argv)
    return args


def test_preset_options_override_the_preset():
    preset = cli.bench_preset(_args("--preset", "full", "--models", "ncf,lm", "--mbits",
                                    "100,1e4", "--builders", "PS,Parallax", "--no-mwms",
                                    "--steps", "3", "--orders", "1"))
    assert preset.models == ("ncf", "lm") and preset.mbits == (100.0, 10000.0)
    assert preset.builders == ("PS", "Parallax") and not preset.mwms and preset.steps == 3
    assert preset.orders == 1
    assert cli.bench_preset(_args()).models == ("mlp", "ncf")          # small by default
    assert len(cli.bench_preset(_args("--builders", "all")).builders) == 8


@pytest.mark.parametrize("argv, message", [
    (["--models", "resnet9"], "unknown ['resnet9']"),
    (["--mbits", "100,fast"], "--mbits: cannot read"),
    (["--mbits", "0"], "positive"),
    (["--builders", "Horovod"], "unknown ['Horovod']"),
    (["--warmup", "1"], "--warmup >= 2"),
    (["--workers", "3"], "does not split across 3 workers"),
])
def test_bad_options_are_named(argv, message, capsys):
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_refuses_without_a_private_namespace(monkeypatch, capsys, tmp_path):
    from autodist.bench import capped_links

    monkeypatch.setattr(capped_links, "can_shape", lambda: False)
    assert cli.main(["bench", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unshare -n" in err and "root" in err
    assert not list(tmp_path.iterdir())


def test_speedup_is_over_the_best_baseline():
    rows = {r.strategy: r for r in _rows()}
    assert rows["AllReduce"].speedup == pytest.approx(1.0)       # the best baseline
    assert rows["optimize"].speedup == pytest.approx(20.0 / 16.0)
    assert rows["PS"].speedup == pytest.approx(0.5)
    assert math.isnan(rows["Parallax"].speedup)
    assert rows["optimize"].examples_per_s == pytest.approx(64 / 0.016)
    assert (rows["PS"].min_ms, rows["PS"].max_ms) == (39.0, 42.0)


def test_reports_round_trip_and_merge(tmp_path):
    rows = _rows()
    paths = emulated.write_reports(rows, str(tmp_path))
    assert [p.rsplit(".", 1)[1] for p in paths][:2] == ["csv", "md"]
    back = emulated.read_csv(paths[0])
    assert [(r.strategy, r.error) for r in back] == [(r.strategy, r.error) for r in rows]
    assert back[2].median_ms == pytest.approx(16.0) and back[2].capped is True
    text = open(paths[1], encoding="utf-8").read()
    assert ("| mlp | 100 | AllReduce 20.0 | search 16.0 | 1.25× | 25.0 | 1.56× | 30.0 "
            "| 1.25× |") in text
    assert "failed: boom" in text and "autodist bench --models mlp" in text
    other = Row(model="ncf", mbit=100.0, workers=2, ps=1, batch_size=64, system=SINGLE,
                strategy="Keras")
    merged = emulated.merge(back, [other])
    assert len(merged) == len(rows) + 1
    assert emulated.merge(merged, [other]) == merged                   # replaced, not added
    assert len(emulated.merge(merged, rows[:1])) == 2                 # mlp@100 replaced


def test_importing_the_bench_package_does_no_work():
    import subprocess
    import sys

    code = "import autodist.bench.emulated, autodist.cli, sys; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
