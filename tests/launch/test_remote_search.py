"""Measured search on served hosts (`autodist.runtime.remote_runner`, `optimize(launch=)`).

Without a cluster: a launch the cluster failed (a served task did not take
its job) fails every strategy at once instead of being measured again in
halves; a local runner refuses a cluster of other hosts, naming the remote
one; `optimize(measure=True, launch="remote")` and `autodist search
--tf-config --trials` measure through the remote runner, and the plan trains
where it was measured. On emulated hosts (`tests.emulated_hosts`, as in
`test_emulated_hosts.py`): `optimize(measure=True, trials=2,
launch="remote")` without a spec plans on TF_CONFIG's cluster probed, its
trials are one job on each served task (their logs show it), and the plan
then trains equal to single-device Keras.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import autodist
from autodist import api, cli
from autodist.ir.errors import AutodistError
from autodist.ir.resource_spec import ResourceSpec
from autodist.launch.cluster_probe import ProbeError
from autodist.launch.errors import TaskFailedError
from autodist.launch.mailbox import MailboxTimeout
from autodist.runtime.local_runner import LaunchRecord, LocalRunner
from autodist.runtime.remote_runner import RemoteRunner
from autodist.search.database import Database
from autodist.search.measurement import SimulatedRunner
from tests import emulated_hosts, small_mlp
from tests.search import workloads

TOLERANCE = 2e-5
_SERVED = {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"], "ps": ["10.0.0.3:2222"]}


def _served_spec() -> ResourceSpec:
    return ResourceSpec.from_tf_config(emulated_hosts.tf_config(_SERVED, "worker", 0),
                                       gpus_per_worker=0)


# ------------------------------------------------------------ without a cluster
def test_a_launch_the_cluster_failed_fails_every_strategy_at_once():
    launches = []

    def launch(first, switch_at, total):
        launches.append([first, *switch_at.values()])
        if "gone" in launches[-1]:
            try:
                raise MailboxTimeout("worker:1 did not answer", "worker:1", "10.0.0.2:2222")
            except MailboxTimeout as e:   # as RemoteCluster.ship raises it
                raise TaskFailedError("task worker:1 did not take its job", "worker:1",
                                      "") from e
        if "bad" in launches[-1]:
            raise TaskFailedError("worker:1 died", "worker:1", "")
        return LaunchRecord([0.1] * total, [{"step": s, "seconds": 0.2} for s in switch_at])

    runner = RemoteRunner(None, _served_spec(), steps=2, warmup_steps=0, launch=launch)
    results = runner.run(["a", "gone", "b", "c"])
    assert len(launches) == 1
    assert all(not r.ok and "did not take its job" in r.error and r.launch_size == 4
               for r in results)

    launches.clear()
    results = runner.run(["a", "bad", "b"])   # a strategy's failure: halves isolate it
    assert [r.ok for r in results] == [True, False, True] and len(launches) > 1
    with pytest.raises(TypeError, match="no allow_exposed"):
        RemoteRunner(None, _served_spec(), launch=launch, allow_exposed=True)


def test_a_local_runner_refuses_other_hosts_and_a_remote_one_checks_the_chief(monkeypatch):
    with pytest.raises(AutodistError, match="LocalRunner measures on this machine only.*"
                                            "launch='remote'"):
        LocalRunner(object(), _served_spec())
    monkeypatch.setenv("TF_CONFIG", emulated_hosts.tf_config(_SERVED, "worker", 1))
    with pytest.raises(AutodistError, match="not the chief"):
        RemoteRunner(object(), _served_spec())


def test_optimize_launch_remote_measures_there_and_its_plan_trains_there(monkeypatch):
    gi = workloads.graph_item([("kernel", (64, 64), False), ("bias", (64,), False)], flops=1e6)
    spec = _served_spec()
    made = []

    def fake_runner(model, resource_spec, **options):
        made.append(options)
        return SimulatedRunner(options["graph_item"], resource_spec)

    monkeypatch.setattr("autodist.runtime.remote_runner.RemoteRunner", fake_runner)
    plan = autodist.optimize(None, spec, graph_item=gi, measure=True, trials=2,
                             cost_model="simulator", search_budget=50, launch="remote",
                             secret_file="/run/secret")
    assert len(plan.trials) == 2 and all(t.error is None for t in plan.trials)
    assert made == [{"graph_item": gi, "batch_size": 64, "secret_file": "/run/secret"}]

    runs = []
    monkeypatch.setattr(api, "distribute", lambda model, strategy, spec, graph_item, **options:
                        runs.append(options) or type("Run", (), {"fit": lambda *a, **k: k})())
    assert plan.fit(None, epochs=1) == {"epochs": 1}
    assert runs[-1] == {"allow_exposed": False, "launch": "remote",
                        "secret_file": "/run/secret"}
    plan.fit(None, launch="local")
    assert runs[-1]["launch"] == "local"
    with pytest.raises(ValueError, match="launch must be one of"):
        autodist.optimize(None, spec, graph_item=gi, launch="ssh")


def test_search_tf_config_measures_on_the_served_hosts(monkeypatch, capsys):
    gi = workloads.graph_item([("kernel", (64, 64), False), ("bias", (64,), False)], flops=1e6)
    made = []

    def fake_runner(model, spec, **options):
        made.append((spec.num_worker_tasks, options["secret_file"]))
        return SimulatedRunner(options["graph_item"], spec)

    monkeypatch.setenv("TF_CONFIG", emulated_hosts.tf_config(_SERVED, "worker", 0))
    monkeypatch.setattr("autodist.launch.cluster_probe.probe_tf_config",  # nothing serves
                        lambda *a, **k: (_ for _ in ()).throw(ProbeError("no answer", ())))
    monkeypatch.setattr(cli, "load_model", lambda model, batch_size=None: (object(), gi))
    monkeypatch.setattr("autodist.runtime.remote_runner.RemoteRunner", fake_runner)
    with pytest.warns(RuntimeWarning, match="as declared.*no answer"):
        assert cli.main(["search", "--model", "fake", "--tf-config", "--trials", "2",
                         "--budget", "50", "--secret-file", "/run/secret", "--json"]) == 0
    assert made == [(2, "/run/secret")]
    assert len(json.loads(capsys.readouterr().out)["trials"]) == 2
    assert cli.main(["search", "--model", "fake", "--secret-file", "/run/secret"]) == 2
    assert "--secret-file goes with --launch remote" in capsys.readouterr().err


# ------------------------------------------------------------ on emulated hosts
def _jobs_received(log_path) -> int:
    return log_path.read_text().count("received a job")


@pytest.mark.cluster
def test_measured_search_runs_its_trials_on_the_served_hosts(request, tmp_path, monkeypatch,
                                                             secret_file):
    """worker:1 on host0, ps:0 on host1, the chief here: optimize(measure=True, trials=2,
    launch="remote") measures both trials in one job on each served task, records them,
    and its plan (a second job there) trains equal to single-device Keras."""
    hosts = emulated_hosts.start(request, count=2)
    tasks = [("worker", 1), ("ps", 0)]
    cluster = emulated_hosts.cluster_on(hosts, tasks)
    servers = [emulated_hosts.serve(host, tmp_path, cluster, kind, index, max_jobs=2)
               for host, (kind, index) in zip(hosts.hosts, tasks)]

    x, y = small_mlp.data(96)
    model = small_mlp.mlp()
    expected = small_mlp.keras_weights(model, x, y, batch=32, epochs=1)
    monkeypatch.setenv("TF_CONFIG", emulated_hosts.tf_config(cluster, "worker", 0))
    db_path = tmp_path / "trials.jsonl"
    plan = autodist.optimize(model, measure=True, trials=2, batch_size=32,
                             database=db_path, launch="remote")   # on TF_CONFIG, probed

    probed = plan.resource_spec   # every task's memory and link to the chief measured
    assert len(probed.nodes) == 3
    assert all(n.cpu_memory_bytes > 0 and n.network_bandwidth_gbps > 0 for n in probed.nodes)

    records = Database(db_path).records()
    assert len(records) == 2 and all(r.ok for r in records), [r.error for r in records]
    assert all(len(r.step_times_s) == 10 and min(r.step_times_s) > 0 for r in records)
    assert [_jobs_received(log) for _, log in servers] == [1, 1]   # both trials: one job
    measured = plan.strategy.proto.performance.measured_step_time_s
    assert np.median(measured) == pytest.approx(min(r.median_step_time_s for r in records))

    plan.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)   # launch="remote"
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    for process, log in servers:   # each served the trials' job and the plan's, then ended
        assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert _jobs_received(log) == 2
