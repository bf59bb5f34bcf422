"""Several replicas per worker task: every builder on the small Transformer.

The MLP and NCF cases, and how the check works, are in test_replicas_per_task.py.
"""
from __future__ import annotations

import pytest

from tests.runtime.test_replicas_per_task import check_every_builder

pytestmark = pytest.mark.cluster


def test_every_builder_on_two_replicas_per_task_equals_single_device(tmp_path):
    check_every_builder("transformer", tmp_path)
