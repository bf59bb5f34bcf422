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
    for name, sub in parser._subparsers._group_actions[0].choices.items():  # pylint: disable=W0212
        for action in sub._actions:  # pylint: disable=W0212
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
