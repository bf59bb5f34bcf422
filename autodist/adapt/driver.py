"""Runs the policies of one fit, in the driver, from the chief's step records."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from autodist.adapt.policy import Control, Policy, StepMetrics
from autodist.ir.errors import AutodistError
from autodist.kernels import monitoring


class PolicyDriver:
    """Runs the policies of one fit from the chief's progress records (driver side).

    Args:
        control: The fit's Control.
        policies: The policies, called in order.
        steps_per_epoch: Steps of one epoch.
        noise_decay: Smoothing of the noise scale (see `SmoothedNoiseScale`).
    """

    def __init__(self, control: Control, policies: Sequence[Policy], steps_per_epoch: int,
                 noise_decay: float = 0.9) -> None:
        for policy in policies:
            if not isinstance(policy, Policy):
                raise AutodistError(f"policies must be autodist Policy objects. "
                                    f"Received: {policy!r}")
        self.control = control
        self.policies = list(policies)
        self.steps_per_epoch = steps_per_epoch
        self._noise = monitoring.SmoothedNoiseScale(noise_decay)

    def begin(self) -> None:
        for policy in self.policies:
            policy.on_train_begin(self.control)

    def step(self, record: Mapping[str, Any]) -> None:
        """One progress record (a step's global loss, time, workers, monitor)."""
        epoch, in_epoch = int(record["epoch"]), int(record["step"])
        seconds = float(record["time"])
        examples = int(record.get("examples", self.control.global_batch_size))
        smoothed = variance = compute = communication = None
        if record.get("monitor", {}).get("compute_s"):
            compute = max(record["monitor"]["compute_s"])
            communication = max(0.0, seconds - compute)
        if "monitor" in record:
            estimate = monitoring.noise_scale_fit(record["monitor"]["batches"],
                                                  record["monitor"]["sq_norms"])
            if estimate is not None:
                smoothed = self._noise.update(estimate)
                variance = estimate.trace_sigma
        metrics = StepMetrics(
            step=epoch * self.steps_per_epoch + in_epoch, epoch=epoch,
            loss=float(record["loss"]), seconds=seconds,
            examples_per_s=examples / seconds if seconds > 0 else 0.0,
            workers=int(record.get("workers", self.control.workers)),
            plan=int(record.get("plan", 0)), noise_scale=smoothed, gradient_variance=variance,
            compute_s=compute, communication_s=communication)
        self.control.metrics.append(metrics)
        for policy in self.policies:
            policy.on_step_end(metrics, self.control)

    def epoch_end(self, epoch: int, logs: Mapping[str, float]) -> None:
        for policy in self.policies:
            policy.on_epoch_end(epoch, logs, self.control)

    def end(self) -> None:
        for policy in self.policies:
            policy.on_train_end(self.control)
