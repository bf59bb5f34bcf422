"""Runs the policies of one fit, in the driver, on every step's metrics."""
from __future__ import annotations

from typing import Mapping, Sequence

from autodist.adapt.policy_interface import Control, Policy, StepMetrics
from autodist.ir.errors import AutodistError


class PolicyDriver:
    """Calls the policies' hooks, in order, with the steps' metrics (driver side).

    The run (`autodist.runtime`) turns each step record of the chief into
    `StepMetrics` and calls `step`; the policies' actions go through the
    `Control`.

    Args:
        control: The fit's Control.
        policies: The policies, called in order.
    """

    def __init__(self, control: Control, policies: Sequence[Policy]) -> None:
        for policy in policies:
            if not isinstance(policy, Policy):
                raise AutodistError(f"policies must be autodist Policy objects. "
                                    f"Received: {policy!r}")
        self.control = control
        self.policies = list(policies)

    def begin(self) -> None:
        for policy in self.policies:
            policy.on_train_begin(self.control)

    def step(self, metrics: StepMetrics) -> None:
        """What the workers measured in one step (steps arrive in order)."""
        self.control.metrics.append(metrics)
        for policy in self.policies:
            policy.on_step_end(metrics, self.control)

    def epoch_end(self, epoch: int, logs: Mapping[str, float]) -> None:
        for policy in self.policies:
            policy.on_epoch_end(epoch, logs, self.control)

    def end(self) -> None:
        for policy in self.policies:
            policy.on_train_end(self.control)
