"""Launch: starting, shipping and stopping the task processes of a cluster.

* `local`: `LocalCluster`, one process per node on this machine.
* `netns`: the private network namespace a local cluster's tasks run in
  (`netns_holder`: the process that holds it, and the interface test).
* `remote`: `RemoteCluster`, a multi-host run (the job shipped over TensorFlow).
* `signing`: jobs sealed with the cluster's shared secret, checked by the task.
* `chunks`: a job cut into signed chunks (no message near 2 GiB), and put
  back together and checked by the task.
* `task`: the life of one task process (server, job, watchdogs, exit codes).
* `server`: a task's TensorFlow server.
* `job`: `JobDir` and `RunConfig`, everything a task reads.
* `private_files`: 0700 directories, 0600 files, temporary names never followed.
* `mailbox`: byte messages between tasks, over TensorFlow itself.
* `errors`: exit codes and `TaskFailedError`.
* `tf_config`: which task a process is, from TF_CONFIG or a spec file.
* `cluster_probe`: a served cluster's devices, memory and links, measured
  into a ResourceSpec.

This layer knows nothing of training: the process entry point
(`autodist.runtime.entry`) hands it the worker loop.
"""
