"""Adaptation: policies that watch a running fit and change it, and the autoscaler.

* `policy`: `Policy` (the hooks), `StepMetrics` (what a step measured) and
  `Control` (the actions a policy may ask for).
* `policies`: the built-in policies (`autodist.policies`).
* `driver`: `PolicyDriver`, which feeds the policies the chief's step records.
* `autoscaler`: the decision logic that chooses a number of workers
  (`autodist.autoscaler`).

Nothing here starts a process or runs a graph: actions reach the workers
through the run (`autodist.runtime`), which calls the driver.
"""
