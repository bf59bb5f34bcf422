"""Cluster tests start real TensorFlow servers: only inside a private network namespace."""
from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("AUTODIST_PRIVATE_NETNS") == "1":
        return
    skip = pytest.mark.skip(reason="needs a private network namespace (run scripts/test.sh, "
                                   "or set AUTODIST_PRIVATE_NETNS=1 inside `unshare -n`)")
    for item in items:
        if "cluster" in item.keywords:
            item.add_marker(skip)
