"""A run's resizes go through its task provider (`ChangeRequests.resize`), and a policy's
grow that no task can serve is refused with the reason (`Control.resize`); no cluster."""
from __future__ import annotations

import json

import pytest

from autodist.adapt.policy_interface import Control
from autodist.adapt.task_providers import ServedHosts, TaskProviderError
from autodist.ir.errors import AutodistError
from autodist.ir.resource_spec import ResourceSpec
from autodist.launch.job import JobDir
from autodist.runtime.change_requests import ChangeRequests
from autodist.runtime.run_config import RunConfig

ADDRESSES = ["c:0", "h0:1", "h1:2", "h2:3"]


def _spec() -> ResourceSpec:
    return ResourceSpec.from_dict({"nodes": [
        {"address": a.split(":")[0], "port": int(a.split(":")[1]), "cpus": [0],
         "chief": i == 0} for i, a in enumerate(ADDRESSES)]})


def _requests(tmp_path, provider=None, members=(0, 1)) -> ChangeRequests:
    """ChangeRequests of an elastic, followed run on `members` (only resize is used)."""
    requests = ChangeRequests(None, None, _spec(), provider)
    config = RunConfig(job_id="j", global_batch_size=8, follow_steps=True, elastic=True)
    requests.open(JobDir.create(tmp_path / "job"), config, members=tuple(members), batch=8,
                  num_examples=16, streaming=False, not_resizable=None)
    return requests


def _asked(tmp_path) -> list[int]:
    return json.loads((tmp_path / "job" / "control" / "resize").read_text())["members"]


def test_a_resize_to_n_asks_the_provider_and_a_list_names_the_tasks(tmp_path):
    served = {"h1:2"}
    requests = _requests(tmp_path, ServedHosts(ADDRESSES, is_served=served.__contains__))
    assert requests.resize(3) == (0, 1, 2)   # worker 2 is the only served idle slot
    assert _asked(tmp_path) == [0, 1, 2]
    with pytest.raises(TaskProviderError, match=r"worker tasks 3 \(h2:3\).*autodist serve"):
        requests.resize(4)
    assert _asked(tmp_path) == [0, 1, 2]   # a refused grow asks nothing
    assert requests.resize([0, 3]) == (0, 3)   # a list is not the provider's choice
    with pytest.raises(AutodistError, match=r"1\.\.4"):
        requests.resize(5)


def test_the_default_provider_keeps_the_lowest_numbered_tasks(tmp_path):
    requests = _requests(tmp_path, members=(0, 2))
    assert requests.resize(3) == (0, 1, 2)
    assert requests.resize(2) == (0, 1)


def test_a_provider_for_another_cluster_is_refused():
    with pytest.raises(AutodistError, match="3 worker tasks; the cluster has 4"):
        ChangeRequests(None, None, _spec(), ServedHosts(ADDRESSES[:3]))


class _RefusingRun:
    """A run whose provider has no task to grow onto."""

    def __init__(self) -> None:
        self.resource_spec, self.strategy = _spec(), None

    def resize(self, workers):
        raise TaskProviderError("ServedHosts has 0 worker tasks available")


def test_a_policys_grow_without_tasks_is_refused_with_the_reason():
    control = Control(_RefusingRun(), 8)
    control.members = (0, 1)
    assert control.resize(3, reason="autoscaler trial") is False
    assert control.members == (0, 1)
    (action,) = control.actions
    assert action["action"] == "resize_refused" and action["workers"] == 3
    assert "autoscaler trial: ServedHosts has 0 worker tasks available" == action["reason"]


class _ServedRun(_RefusingRun):
    """A run on `ADDRESSES` where slot 2's `autodist serve` does not answer."""

    def __init__(self) -> None:
        super().__init__()
        self.task_provider = ServedHosts(ADDRESSES, is_served=lambda a: a != "h1:2")
        self.asked: list[tuple[int, ...]] = []

    def resize(self, workers):
        self.asked.append(tuple(workers))
        return tuple(workers)


def test_a_replaced_straggler_gives_its_place_to_a_served_spare_only():
    run = _ServedRun()
    control = Control(run, 8)
    control.members = (0, 1)
    control.replace([1], reason="straggler")
    assert run.asked == [(0, 3)]   # slot 2 is idle but not served
