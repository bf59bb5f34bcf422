"""Measures strategies on a multi-host cluster: the search's `Runner` on served tasks.

`RemoteRunner` measures as `LocalRunner` does (many strategies per launch,
switched in place; a failed launch measured again in halves; the model's
weights restored after every launch), but each launch is a job shipped to
the cluster's other tasks, which run `autodist serve` (``launch="remote"``,
see docs/multihost.md): this process is the chief. Every launch is one job
for every served task, so serve them without `--max-jobs` (or with one
above the launches a search makes: a round of trials is one launch per
measuring order, plus one per failed launch's halves).

A launch that fails because the cluster itself failed (a served task did
not take its job within `startup_timeout_s`, rejected it, or the secret
cannot be read) fails every strategy of that launch at once: measuring them
again in halves would only wait for the same task again.

Used by `autodist.optimize(measure=True, launch="remote")` and `autodist
search --trials N --launch remote`.

Example:
    >>> spec = autodist.ResourceSpec.from_tf_config()              # doctest: +SKIP
    >>> runner = RemoteRunner(model, spec, batch_size=64)
    >>> [r.median_step_time_s for r in runner.run([s1, s2])]        # one job per task
"""
from __future__ import annotations

from typing import Any

from autodist.ir.errors import UnknownArgumentError
from autodist.ir.resource_spec import ResourceSpec
from autodist.launch import mailbox, signing
from autodist.launch.tf_config import check_this_is_the_chief
from autodist.runtime.local_runner import LocalRunner


class RemoteRunner(LocalRunner):
    """Trains a few steps per strategy on served hosts and reports step times.

    Args:
        model: The compiled Keras model (its weights are restored after
            every launch).
        resource_spec: The cluster (`ResourceSpec.from_tf_config()`, or a
            YAML whose other hosts run `autodist serve --cluster`); this
            process is its chief.
        secret_file: The cluster's shared secret, as for `DistributedRun`
            (default: ``AUTODIST_SECRET_FILE``, else ``AUTODIST_SECRET``).
        **options: As for `LocalRunner` (batch_size, steps, warmup_steps,
            per_launch, orders, x, y, graph_item, timeout_s, step_timeout_s,
            startup_timeout_s, log, launch); not allow_exposed, which is for
            local clusters.

    Raises:
        AutodistError: This process is not the cluster's chief (TF_CONFIG
            names another task).
        SecretError: The secret cannot be read or is too short.
    """

    def __init__(self, model, resource_spec: ResourceSpec, *, secret_file: str | None = None,
                 **options: Any) -> None:
        if "allow_exposed" in options:
            raise UnknownArgumentError("RemoteRunner takes no allow_exposed (it is for "
                                       "local clusters)")
        if options.get("launch") is None:
            check_this_is_the_chief(resource_spec)
            signing.load_secret(secret_file)   # unreadable: said now, not per launch
        self.secret_file = secret_file
        super().__init__(model, resource_spec, **options)

    @staticmethod
    def _check_cluster(resource_spec: ResourceSpec) -> None:
        """Any hosts will do: the other tasks are served there."""

    def _run_options(self) -> dict[str, Any]:
        return {"launch": "remote", "secret_file": self.secret_file}

    @staticmethod
    def _splits(error: BaseException) -> bool:
        """False when the cluster failed the launch, not a strategy: a served task did not
        take its job (its mailbox did not answer) or rejected it, or the secret is bad."""
        seen: set[int] = set()
        cause: BaseException | None = error
        while cause is not None and id(cause) not in seen:   # what it was raised from
            if isinstance(cause, (mailbox.MailboxError, signing.JobRejectedError,
                                  signing.SecretError)):
                return False
            seen.add(id(cause))
            cause = cause.__cause__
        return True
