"""Launch: starting, shipping and stopping the task processes of a cluster.

* `local`: `LocalCluster`, one process per node on this machine.
* `remote`: `RemoteCluster`, a multi-host run (the job shipped over TensorFlow).
* `task`: the life of one task process (server, job, watchdogs, exit codes).
* `server`: a task's TensorFlow server.
* `job`: `JobDir` and `RunConfig`, everything a task reads.
* `mailbox`: byte messages between tasks, over TensorFlow itself.
* `errors`: exit codes and `TaskFailedError`.
* `tf_config`: which task a process is, from TF_CONFIG or a spec file.

This layer knows nothing of training: the process entry point
(`autodist.runtime.entry`) hands it the worker loop.
"""
