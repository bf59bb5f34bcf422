"""Fixtures of the launch tests: the cluster's shared secret."""
from __future__ import annotations

import pytest

from autodist.launch.signing import SECRET_ENV, SECRET_FILE_ENV

SECRET = "the-cluster-secret-0123456789abcdef"


@pytest.fixture
def secret_file(tmp_path, monkeypatch):
    """The cluster's secret, mounted as a file (as a Kubernetes secret is), for every task
    this test starts (AUTODIST_SECRET_FILE) and for the chief's side here."""
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    monkeypatch.delenv(SECRET_ENV, raising=False)
    return path
