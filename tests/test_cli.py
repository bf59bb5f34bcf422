"""The command line: inspect, strategy build / show, and its errors."""
from __future__ import annotations

import subprocess
import sys

import pytest

from autodist import cli
from autodist.ir.strategy import Strategy


def test_inspect_prints_variable_table(capsys, tmp_path):
    out_file = tmp_path / "mlp.pb"
    assert cli.main(["inspect", "mlp", "--save", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "dense_0/kernel  784x256" in out
    assert "name" in out and "sparse" in out and "axes" in out
    assert out_file.exists()
    # A saved GraphItem is a valid MODEL argument and needs no re-capture.
    assert cli.main(["inspect", str(out_file)]) == 0
    assert "dense_0/kernel" in capsys.readouterr().out


def test_strategy_build_and_show(capsys, tmp_path):
    gi_file = tmp_path / "ncf.pb"
    strategy_file = tmp_path / "s.pb"
    cluster = tmp_path / "cluster.yml"
    cluster.write_text("nodes:\n  - address: a\n    chief: true\n  - address: b\n")
    assert cli.main(["inspect", "ncf", "--save", str(gi_file)]) == 0
    assert cli.main(["strategy", "build", "Parallax", "--model", str(gi_file),
                     "--cluster", str(cluster), "--out", str(strategy_file)]) == 0
    strategy = Strategy.load(strategy_file)
    assert strategy.origin == "Parallax"
    capsys.readouterr()
    assert cli.main(["strategy", "show", str(strategy_file), "--text", "--graph-item",
                     str(gi_file), "--cluster", str(cluster)]) == 0
    out = capsys.readouterr().out
    assert "user_embedding/embeddings" in out and "PS(" in out and "AllReduce(" in out
    assert 'origin: "Parallax"' in out
    assert "valid for the given GraphItem and cluster" in out


@pytest.mark.parametrize("argv,message", [
    (["inspect", "no_such_model"], "unknown model 'no_such_model'"),
    (["inspect", "missing.keras"], "does not exist"),
    (["strategy", "build", "Nope", "--model", "mlp"], "unknown builder 'Nope'"),
    (["strategy", "show", "/nonexistent/s.pb"], "cannot read strategy file"),
    (["serve"], "serve needs exactly one of --tf-config and --cluster"),
    (["serve", "--cluster", "/nonexistent/c.yml", "--task", "worker:1"],
     "cannot read resource spec '/nonexistent/c.yml'"),
    (["serve", "--cluster", "c.yml", "--task", "worker:1", "--cpu-replicas-per-worker", "2"],
     "--gpus-per-worker and --cpu-replicas-per-worker go with --tf-config"),
])
def test_errors_are_reported_not_raised(capsys, argv, message):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_console_script_entry_point():
    result = subprocess.run([sys.executable, "-m", "autodist.cli", "--help"],
                            capture_output=True, text=True, timeout=60, check=True)
    assert "inspect" in result.stdout and "strategy" in result.stdout


def test_import_does_no_tensorflow_work():
    code = "import sys, autodist; print('tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == "False"


def test_serve_checks_the_task_before_starting(capsys, tmp_path, monkeypatch):
    cluster = tmp_path / "cluster.yml"
    cluster.write_text("nodes:\n  - address: a:2222\n    chief: true\n  - address: b:2222\n")
    assert cli.main(["serve", "--cluster", str(cluster), "--task", "worker:7"]) == 2
    assert "one of ['worker:0', 'worker:1']. Received: 'worker:7'" in capsys.readouterr().err
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1", "b:1"]}, '
                                    '"task": {"type": "worker", "index": 2}}')
    assert cli.main(["serve", "--tf-config"]) == 2
    assert "must name this process's task in its cluster" in capsys.readouterr().err


def test_serve_needs_a_secret_or_insecure(capsys, tmp_path, monkeypatch):
    """Checked before any process starts: no secret, an unreadable one, or both kinds."""
    cluster = tmp_path / "cluster.yml"
    cluster.write_text("nodes:\n  - address: a:2222\n    chief: true\n  - address: b:2222\n")
    serve = ["serve", "--cluster", str(cluster), "--task", "worker:1", "--job-timeout", "0.1"]
    monkeypatch.delenv("AUTODIST_SECRET", raising=False)
    monkeypatch.delenv("AUTODIST_SECRET_FILE", raising=False)
    assert cli.main(serve) == 2
    err = capsys.readouterr().err
    assert "runs only jobs signed with the cluster's shared secret, and none was given" in err
    assert "--secret-file FILE" in err and "--insecure" in err
    assert cli.main([*serve, "--secret-file", str(tmp_path / "missing")]) == 2
    assert f"cannot read the secret file '{tmp_path / 'missing'}'" in capsys.readouterr().err
    monkeypatch.setenv("AUTODIST_SECRET", "a-secret-long-enough-to-use")
    assert cli.main([*serve, "--insecure"]) == 2
    assert "--insecure serves without a secret, but a secret was given" in capsys.readouterr().err


def test_version_and_help_on_every_flag(capsys):
    from autodist import __version__

    with pytest.raises(SystemExit) as raised:
        cli.main(["--version"])
    assert raised.value.code == 0 and capsys.readouterr().out.strip() == f"autodist {__version__}"
    parser = cli.build_parser()
    missing = []
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            if action.option_strings and action.help is None:
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, missing


def test_a_model_function_of_the_current_directory_loads(capsys, tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        "import keras\n"
        "def build():\n"
        "    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
        "    model.compile(optimizer='sgd', loss='mse')\n"
        "    return model\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert cli.main(["inspect", "mymodels:build"]) == 0
    assert "dense" in capsys.readouterr().out
    assert cli.main(["inspect", "nomodule:build"]) == 2
    assert "cannot load 'nomodule:build' (from" in capsys.readouterr().err


# ------------------------------------------------------------- --json, --plot, workloads
@pytest.fixture
def synthetic(tmp_path, captured):
    """A saved small NCF GraphItem, a cluster file and a Parallax strategy."""
    from autodist.ir.resource_spec import ResourceSpec
    from autodist.search import builders

    item = captured("ncf", num_users=500, num_items=1000, dim=8)
    item.save(tmp_path / "gi.pb")
    cluster = tmp_path / "cluster.yml"
    cluster.write_text("nodes:\n  - address: a\n    chief: true\n    roles: [worker]\n"
                       "  - address: b\n    roles: [worker]\n  - address: c\n    roles: [ps]\n")
    spec = ResourceSpec.from_yaml(cluster)
    strategy = builders.get("Parallax")().build(item, spec)
    strategy.save(tmp_path / "s.pb")
    return item, spec, tmp_path


def _json(capsys) -> dict:
    """The one JSON object on stdout; docs/cli.md documents each of its keys."""
    import json
    import pathlib

    data = json.loads(capsys.readouterr().out)
    doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    undocumented = [key for key in data if f"`{key}`" not in doc]
    assert not undocumented, f"keys missing from docs/cli.md: {undocumented}"
    return data


def test_inspect_json(capsys, synthetic):
    item, _, tmp = synthetic
    assert cli.main(["inspect", str(tmp / "gi.pb"), "--json"]) == 0
    data = _json(capsys)
    assert data["schema_version"] == cli.JSON_SCHEMA_VERSION and data["saved_to"] is None
    gi = data["graph_item"]
    assert gi["fingerprint"] == item.fingerprint and gi["name"] == "ncf"
    assert gi["variables"][0] == {"name": "user_embedding/embeddings", "shape": [500, 8],
                                  "dtype": "float32", "bytes": 16000, "sparse_gradient": True,
                                  "partitionable_axes": [0], "slots": ["momentum", "velocity"]}
    assert {"num_parameters", "total_variable_bytes", "total_flops", "optimizer",
            "state_variables", "inputs", "estimate_batch_size"} <= set(gi)


def test_strategy_show_json_and_plot(capsys, synthetic):
    pytest.importorskip("matplotlib")
    _, _, tmp = synthetic
    png = tmp / "s.png"
    assert cli.main(["strategy", "show", str(tmp / "s.pb"), "--graph-item", str(tmp / "gi.pb"),
                     "--cluster", str(tmp / "cluster.yml"), "--plot", str(png), "--json"]) == 0
    data = _json(capsys)
    assert png.stat().st_size > 10_000 and data["plot"] == str(png) and data["valid"] is True
    strategy = data["strategy"]
    assert strategy["origin"] == "Parallax" and len(strategy["replicas"]) == 2
    emb, kernel = strategy["variables"][0], strategy["variables"][2]
    assert emb["shards"][0]["kind"] == "ps" and emb["shards"][0]["sync"] is True
    assert emb["shards"][0]["device"] == "/job:ps/task:0/device:CPU:0"
    assert kernel["name"] == "mlp_hidden/kernel" and kernel["shards"][0]["kind"] == "all_reduce"
    assert kernel["shards"][0]["spec"] in ("AUTO", "RING")
    assert set(strategy["performance"]) == {"measured_median_step_time_s",
                                            "measured_step_time_s", "predicted_step_time_s",
                                            "lower_bound_step_time_s", "predictor"}
    layout = data["layout"]
    devices = {d["device"]: {h["variable"] for h in d["holds"]} for d in layout["devices"]}
    dense = {"mlp_hidden/kernel", "mlp_hidden/bias", "logit/kernel", "logit/bias"}
    assert devices == {"/job:worker/task:0/device:CPU:0": dense,
                       "/job:worker/task:1/device:CPU:0": dense,
                       "/job:ps/task:0/device:CPU:0": {"user_embedding/embeddings",
                                                       "item_embedding/embeddings"}}
    assert [link["task"] for link in layout["links"]] == ["worker:0", "worker:1", "ps:0"]
    assert set(layout["links"][0]) == {"node", "task", "bandwidth_gbps", "bytes_in_per_step",
                                       "bytes_out_per_step", "seconds_per_step"}
    assert layout["predicted_step_time_s"] > 0 and layout["memory"]
    # Text output names the figure; without a GraphItem the figure has no link bytes.
    assert cli.main(["strategy", "show", str(tmp / "s.pb"), "--plot", str(png)]) == 0
    assert "no bytes per link: pass --graph-item" in capsys.readouterr().out
    assert cli.main(["strategy", "show", str(tmp / "s.pb"), "--json"]) == 0
    data = _json(capsys)
    assert data["valid"] is None and data["layout"]["links"] is None


def test_strategy_show_errors(capsys, synthetic, monkeypatch):
    _, _, tmp = synthetic
    assert cli.main(["strategy", "show", str(tmp / "s.pb"), "--cluster",
                     str(tmp / "cluster.yml")]) == 2
    assert "--cluster goes with --graph-item" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert cli.main(["strategy", "show", str(tmp / "s.pb"), "--plot", str(tmp / "x.png")]) == 2
    captured = capsys.readouterr()
    assert 'pip install "autodist[plot]"' in captured.err and not (tmp / "x.png").exists()


def _fake_measuring(monkeypatch, item):
    """`search --trials` without a cluster: the simulator "measures" (SimulatedRunner)."""
    from autodist.search.measurement import SimulatedRunner

    monkeypatch.setattr(cli, "load_model", lambda model, batch_size=None: (object(), item))
    monkeypatch.setattr("autodist.runtime.local_runner.LocalRunner",
                        lambda model, spec, graph_item, batch_size: SimulatedRunner(
                            graph_item, spec, spread=(1.5, 1.6, 1.4)))


def test_search_json(capsys, synthetic):
    item, spec, tmp = synthetic
    assert cli.main(["search", "--model", str(tmp / "gi.pb"), "--cluster",
                     str(tmp / "cluster.yml"), "--budget", "100", "--json",
                     "--out", str(tmp / "found.pbtxt")]) == 0
    data = _json(capsys)   # progress and the space's description went to stderr
    assert data["workload"] == {
        "name": "ncf@2workers+1ps", "key": f"{item.fingerprint}:{spec.fingerprint}",
        "model": "ncf", "cluster": "2workers+1ps",
        "graph_item_fingerprint": item.fingerprint, "resource_spec_fingerprint": spec.fingerprint}
    assert data["measured_step_time_s"] is None and data["trials"] == []
    assert data["predicted_step_time_s"] > 0 and data["out"] == str(tmp / "found.pbtxt")
    assert {"candidates_scored", "elapsed_s", "lower_bound_step_time_s", "predictor",
            "builder_step_times_s", "builder_errors", "strategy"} <= set(data)
    assert Strategy.load(tmp / "found.pbtxt").id == data["strategy"]["id"]


def test_measured_search_leads_with_measured_times_and_export_keeps_them(
        capsys, synthetic, monkeypatch):
    item, _, tmp = synthetic
    _fake_measuring(monkeypatch, item)
    db = tmp / "trials.jsonl"
    search = ["search", "--model", "fake", "--cluster", str(tmp / "cluster.yml"),
              "--trials", "3", "--budget", "100", "--database", str(db)]
    assert cli.main(search) == 0
    out = capsys.readouterr().out
    assert out.index("measured trials (fastest first):") < out.index("pick: measured") \
        < out.index("predicted step time")
    assert "measured step time:" in out   # the summary, before its predicted time
    assert cli.main([*search, "--json"]) == 0   # resumes, measuring 3 more
    data = _json(capsys)
    assert data["measured_step_time_s"] > data["predicted_step_time_s"]   # 1.5x slower
    assert data["strategy"]["performance"]["measured_median_step_time_s"] == pytest.approx(
        data["measured_step_time_s"])

    out_file = tmp / "best.pbtxt"
    assert cli.main(["export", str(db), "--out", str(out_file)]) == 0
    text = capsys.readouterr().out
    assert "measured trials of ncf@2workers+1ps: measured" in text
    assert "(with its measured step times)" in text
    exported = Strategy.load(out_file)
    assert len(exported.proto.performance.measured_step_time_s) == 3
    assert exported.proto.performance.predicted_step_time_s > 0
    assert cli.main(["export", str(db), "--out", str(out_file), "--json"]) == 0
    data = _json(capsys)
    assert data["workload"]["name"] == "ncf@2workers+1ps"
    assert data["workload"]["graph_item_fingerprint"] == item.fingerprint
    assert data["trials"] >= 3 and len(data["best"]["measured_step_time_s"]) == 3
    assert data["best"]["measured_median_step_time_s"] == pytest.approx(
        data["strategy"]["performance"]["measured_median_step_time_s"])


def test_export_names_workloads_by_model_and_cluster(capsys, tmp_path):
    from autodist.ir.resource_spec import ResourceSpec
    from autodist.search import builders
    from autodist.search.database import Database, TrialRecord
    from tests.search.workloads import graph_item

    db = Database(tmp_path / "t.jsonl")
    item = graph_item([("kernel", (64, 32), False)], name="mlp")
    other = graph_item([("kernel", (64, 16), False)], name="mlp")   # same name, other model
    specs = [ResourceSpec.local(2, 1, cpu_memory=0),
             ResourceSpec.local(4, 0, bandwidth_gbps=10, cpu_memory=0)]
    for gi, spec in ((item, specs[0]), (item, specs[1]), (other, specs[1])):
        db.append(TrialRecord.from_trial(gi, spec, builders.AllReduce().build(gi, spec),
                                         step_times_s=(0.01, 0.02, 0.03)))
    out = tmp_path / "s.pb"
    assert cli.main(["export", str(db.path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds 3 workloads with measured trials; pick one with --workload NAME" in err
    first, second = (f"mlp@4workers@10gbit#{gi.fingerprint[:8]}" for gi in (item, other))
    assert "mlp@2workers+1ps (1 trials)" in err and first in err and second in err
    assert cli.main(["export", str(db.path), "--out", str(out), "--workload",
                     "mlp@2workers+1ps", "--json"]) == 0
    assert _json(capsys)["workload"]["cluster"] == "2workers+1ps"
    key = f"{other.fingerprint}:{specs[1].fingerprint}"
    for name in (second, key, key[:12]):
        assert cli.main(["export", str(db.path), "--out", str(out), "--workload", name,
                         "--json"]) == 0
        assert _json(capsys)["workload"]["key"] == key
    assert cli.main(["export", str(db.path), "--out", str(out), "--workload", "nope"]) == 2
    assert "no measured trial of workload 'nope'" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli.main(["export", str(empty), "--out", str(out)]) == 2
    assert "holds no measured trial" in capsys.readouterr().err


def test_describe_cluster():
    from autodist.ir.resource_spec import ResourceSpec

    assert cli.describe_cluster(ResourceSpec.local(1, 0, cpu_memory=0)) == "1worker"
    assert cli.describe_cluster(ResourceSpec.local(2, 1, bandwidth_gbps=0.1,
                                                   cpu_memory=0)) == "2workers+1ps@0.1gbit"
    assert cli.describe_cluster(ResourceSpec.local(2, 0, gpus_per_worker=4,
                                                   cpu_memory=0)) == "2workers-8gpus"
