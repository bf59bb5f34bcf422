"""Shared fixtures: example models are captured once per test session."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from autodist.ir.resource_spec import ResourceSpec


@pytest.fixture(scope="session")
def captured():
    """A function name -> GraphItem of the example model, cached for the session."""
    from autodist import models
    from autodist.ir.capture import capture

    cache = {}

    def get(name: str, **kwargs):
        key = (name, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = capture(models.build(name, **kwargs))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def mlp_item(captured):
    return captured("mlp")


@pytest.fixture(scope="session")
def cnn_item(captured):
    return captured("cnn")


@pytest.fixture(scope="session")
def ncf_item(captured):
    """Two embedding tables (sparse gradients); item table has a prime row count."""
    return captured("ncf", num_users=1000, num_items=20011, dim=64)


@pytest.fixture(scope="session")
def transformer_item(captured):
    return captured("transformer")


@pytest.fixture
def local_spec():
    return ResourceSpec.local(workers=2, ps=1)


@pytest.fixture
def hetero_spec():
    """2 workers and 3 PS nodes; the second PS has 4x the bandwidth."""
    return ResourceSpec.from_dict({"nodes": [
        {"address": "w0", "chief": True, "network_bandwidth": 10, "roles": ["worker"]},
        {"address": "w1", "network_bandwidth": 10, "roles": ["worker"]},
        {"address": "p0", "network_bandwidth": 10, "roles": ["ps"]},
        {"address": "p1", "network_bandwidth": 40, "roles": ["ps"]},
        {"address": "p2", "network_bandwidth": 10, "roles": ["ps"]},
    ]})


def pytest_collection_modifyitems(config, items):
    """Cluster tests start real TensorFlow servers: only inside a private network namespace."""
    if os.environ.get("AUTODIST_PRIVATE_NETNS") == "1":
        return
    skip = pytest.mark.skip(reason="needs a private network namespace (run scripts/test.sh, "
                                   "or set AUTODIST_PRIVATE_NETNS=1 inside `unshare -n`)")
    for item in items:
        if "cluster" in item.keywords:
            item.add_marker(skip)
