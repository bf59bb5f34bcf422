"""A job directory: everything a task process needs, as files.

Workers never run the user's script: they read the GraphItem, Strategy and
ResourceSpec protobufs, the initial values and the training data from here,
and write their logs and results here.

    job_dir/
      graph_item.pb  strategy.pb  resource_spec.pb
      run.json         RunConfig (batching, epochs, timeouts)
      cluster.json     ports of every node
      init.npz         initial values by variable name
      data/x_0.npy ... data/y.npy
      logs/<job>_<task>.log
      ready/<job>_<task>         written when a task's server is up
      results/worker_<i>.json    per-step losses and times
      progress.jsonl             the chief's progress, one line per step
      final_weights.npz          trained values by variable name (chief)
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import numpy as np

from autodist.ir.atomic import atomic_write
from autodist.ir.graph_item import GraphItem
from autodist.ir.resource_spec import ResourceSpec
from autodist.ir.strategy import Strategy


@dataclasses.dataclass
class RunConfig:
    """How a job trains.

    Attributes:
        global_batch_size: Examples per step over all replicas.
        epochs: Passes over the data.
        steps_per_epoch: Steps per epoch (None: ceil(examples / batch)).
        shuffle: Shuffle the examples each epoch (seeded by `seed` and epoch).
        seed: Seed of the shuffling.
        step_timeout_s: Bound on one step (collectives, PS waits, session runs).
        startup_timeout_s: Bound on waiting for the cluster to come up.
        checkpoint_dir: Where the chief writes checkpoints (None: none).
        checkpoint_every_steps: Steps between checkpoints (None: each epoch's end).
        task_step_delay_s: Worker task index (as a string) -> seconds to sleep
            before each step: an emulated slow worker, for tests and benchmarks.
    """

    global_batch_size: int
    epochs: int = 1
    steps_per_epoch: int | None = None
    shuffle: bool = False
    seed: int = 0
    step_timeout_s: float = 60.0
    startup_timeout_s: float = 120.0
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int | None = None
    task_step_delay_s: dict[str, float] | None = None


class JobDir:
    """Paths and readers/writers of one job directory."""

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)

    # paths
    def file(self, name: str) -> pathlib.Path:
        return self.path / name

    def log(self, job: str, task: int) -> pathlib.Path:
        return self.path / "logs" / f"{job}_{task}.log"

    def ready_flag(self, job: str, task: int) -> pathlib.Path:
        return self.path / "ready" / f"{job}_{task}"

    def result(self, task: int) -> pathlib.Path:
        return self.path / "results" / f"worker_{task}.json"

    # writing (driver side)
    def write(self, graph_item: GraphItem, strategy: Strategy, spec: ResourceSpec,
              config: RunConfig, init_values: dict[str, np.ndarray],
              inputs: list[np.ndarray], targets: np.ndarray) -> None:
        for sub in ("logs", "ready", "results", "data"):
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        graph_item.save(self.file("graph_item.pb"))
        strategy.save(self.file("strategy.pb"))
        atomic_write(self.file("resource_spec.pb"), spec.serialize())
        atomic_write(self.file("run.json"), json.dumps(dataclasses.asdict(config)).encode())
        np.savez(self.file("init.npz"), **init_values)
        for i, x in enumerate(inputs):
            np.save(self.path / "data" / f"x_{i}.npy", x)
        np.save(self.path / "data" / "y.npy", targets)

    def write_ports(self, ports: list[int]) -> None:
        atomic_write(self.file("cluster.json"), json.dumps({"ports": ports}).encode())

    # reading (task side)
    def graph_item(self) -> GraphItem:
        return GraphItem.load(self.file("graph_item.pb"))

    def strategy(self) -> Strategy:
        return Strategy.load(self.file("strategy.pb"))

    def resource_spec(self) -> ResourceSpec:
        return ResourceSpec.deserialize(self.file("resource_spec.pb").read_bytes())

    def config(self) -> RunConfig:
        return RunConfig(**json.loads(self.file("run.json").read_text()))

    def ports(self) -> list[int]:
        return json.loads(self.file("cluster.json").read_text())["ports"]

    def init_values(self) -> dict[str, np.ndarray]:
        with np.load(self.file("init.npz")) as data:
            return {k: data[k] for k in data.files}

    def data(self) -> tuple[list[np.ndarray], np.ndarray]:
        xs = sorted((self.path / "data").glob("x_*.npy"), key=lambda p: int(p.stem[2:]))
        return ([np.load(p, mmap_mode="r") for p in xs],
                np.load(self.path / "data" / "y.npy", mmap_mode="r"))

    def read_json(self, path: pathlib.Path) -> Any:
        return json.loads(path.read_text())
