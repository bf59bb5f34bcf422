"""The code passes ruff (ruff.toml), with the version the `test` extra pins.

CI runs the README's test command, so this is how the linter runs in CI; the
pre-commit hook runs the same version on each commit.
"""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pinned_ruff() -> str:
    match = re.search(r'"ruff==([0-9.]+)"', (ROOT / "setup.py").read_text(encoding="utf-8"))
    assert match, "setup.py's test extra pins ruff (\"ruff==X.Y.Z\")"
    return match.group(1)


def test_ruff_finds_nothing():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_pre_commit_runs_the_pinned_ruff():
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text(encoding="utf-8"))
    revs = [repo["rev"] for repo in config["repos"] if repo["repo"].endswith("/ruff-pre-commit")]
    assert revs == [f"v{_pinned_ruff()}"]
    version = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True,
                             text=True, timeout=60, check=True).stdout.split()[-1]
    assert version == _pinned_ruff(), f"installed ruff {version}; setup.py pins {_pinned_ruff()}"
