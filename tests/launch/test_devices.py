"""A task's devices: its environment (GPUs) and its server's config (logical CPUs)."""
from __future__ import annotations

import pytest

from autodist.ir.resource_spec import ResourceSpec, TaskDevices
from autodist.launch.devices import check_shipped_devices, task_environment, task_environments
from autodist.launch.errors import DeviceSetupError
from autodist.launch.job import JobDir
from autodist.launch.local import LocalCluster


def test_a_task_without_gpus_sees_none():
    env = task_environment(TaskDevices(cpus=2, gpus=()), ["0", "1"])
    assert env == {"CUDA_VISIBLE_DEVICES": "", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}


def test_a_task_gets_its_nodes_gpus_among_those_the_host_shows():
    # The host (the launcher's CUDA_VISIBLE_DEVICES) shows 4, 5, 6, 7; the node has its 2nd and 4th.
    env = task_environment(TaskDevices(cpus=1, gpus=(1, 3)), ["4", "5", "6", "7"])
    assert env["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"


def test_task_environments_of_a_local_gpu_spec():
    spec = ResourceSpec.local(workers=2, ps=1, gpus_per_worker=2)
    envs = task_environments(spec, [0, 1, 2], {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert [envs[i]["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["0,1", "2,3", ""]


def test_missing_gpus_are_named():
    spec = ResourceSpec.local(workers=2, gpus_per_worker=2)
    with pytest.raises(DeviceSetupError, match=r"task worker:1 \(node 1\) has GPUs \[2, 3\] but "
                                               r"this host shows 3 .*GPUs \[3\] do not exist"):
        task_environments(spec, [0, 1], {"CUDA_VISIBLE_DEVICES": "0,1,2"})


def test_local_cluster_checks_gpus_before_starting_a_process(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    spec = ResourceSpec.local(workers=1, gpus_per_worker=1)
    cluster = LocalCluster(JobDir(tmp_path), spec, task_module="no.such.module")
    with pytest.raises(DeviceSetupError, match=r"task worker:0 \(node 0\) has GPUs \[0\] but "
                                               "this host shows 0"):
        cluster.start()
    assert cluster.tasks == []


def test_server_config_makes_logical_cpus():
    from autodist.launch.server import COLLECTIVE_LEADER, server_config  # imports TensorFlow

    config = server_config(TaskDevices(cpus=3, gpus=()))
    assert config.device_count["CPU"] == 3
    assert config.experimental.collective_group_leader == COLLECTIVE_LEADER
    assert config.gpu_options.allow_growth
    assert "CPU" not in server_config(TaskDevices(cpus=1, gpus=())).device_count
    assert "CPU" not in server_config().device_count


def test_tasks_sharing_a_host_split_its_cores(monkeypatch):
    from autodist.launch.server import intra_op_threads, server_config  # imports TensorFlow

    monkeypatch.delenv("TF_NUM_INTRAOP_THREADS", raising=False)
    local = {"worker": ["localhost:1", "127.0.0.1:2", "localhost:3"], "ps": ["[::1]:4"]}
    assert [intra_op_threads(local, "worker", t, cores=6) for t in (0, 1, 2)] == [2, 2, 2]
    assert intra_op_threads(local, "ps", 0, cores=6) == 2
    assert intra_op_threads(local, "ps", 0, cores=2) == 1   # at least one
    hosts = {"worker": ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.2:2"], "ps": ["10.0.0.1:2"]}
    # Alone on its host, or beside a PS only: TensorFlow's default (every core).
    assert intra_op_threads(hosts, "worker", 0, cores=8) is None
    assert intra_op_threads(hosts, "ps", 0, cores=8) is None
    assert intra_op_threads(hosts, "worker", 2, cores=8) == 4
    assert server_config(threads=3).intra_op_parallelism_threads == 3
    assert server_config().intra_op_parallelism_threads == 0
    monkeypatch.setenv("TF_NUM_INTRAOP_THREADS", "5")   # the user's choice stands
    assert intra_op_threads(local, "worker", 0, cores=8) is None


def test_a_task_without_its_gpus_fails_before_its_server_starts():
    import tensorflow as tf

    from autodist.launch.server import check_gpus

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this host has a GPU")
    check_gpus(TaskDevices(cpus=2, gpus=()), "task worker:0")
    with pytest.raises(DeviceSetupError, match=r"task worker:1 should have 2 GPUs \(the host's "
                                               r"\[2, 3\]\) but TensorFlow shows it 0"):
        check_gpus(TaskDevices(cpus=1, gpus=(2, 3)), "task worker:1")


def test_a_served_task_checks_the_chiefs_devices():
    chief = ResourceSpec.local(workers=2, ps=1, cpu_replicas_per_worker=2)
    check_shipped_devices(chief, "worker", 1, TaskDevices(cpus=2, gpus=()))
    check_shipped_devices(chief, "ps", 0, TaskDevices(cpus=1, gpus=()))
    with pytest.raises(DeviceSetupError, match=r"gives task worker:1 TaskDevices\(cpus=2, "
                                               r"gpus=\(\)\), but its server started with "
                                               r"TaskDevices\(cpus=1, gpus=\(\)\).*"
                                               "--cpu-replicas-per-worker"):
        check_shipped_devices(chief, "worker", 1, TaskDevices(cpus=1, gpus=()))
