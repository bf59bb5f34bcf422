"""Entry point of one task process: ``python -m autodist.runtime.task``.

    python -m autodist.runtime.task --job-dir DIR --job worker --task 0

Starts this task's TensorFlow server, marks it ready, and (for a worker)
trains from the job directory. A parameter-server task serves until it is
stopped. Exit codes: 0 done, 1 failed (traceback in the log), 3 the port was
taken (the launcher retries with other ports).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import traceback

EXIT_FAILED = 1
EXIT_PORT_IN_USE = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job-dir", required=True)
    parser.add_argument("--job", choices=("worker", "ps"), required=True)
    parser.add_argument("--task", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, default=0,
                        help="exit when this process (the launcher) is gone")
    args = parser.parse_args(argv)
    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from autodist.runtime.job import JobDir  # pylint: disable=import-outside-toplevel
    from autodist.runtime.worker import run_worker, session_config  # pylint: disable=C0415

    job = JobDir(args.job_dir)
    try:
        spec = job.resource_spec()
        strategy = job.strategy()
        config = job.config()
        cluster = tf.train.ClusterSpec(spec.cluster_def(job.ports()))
        server_config = session_config(strategy, args.task if args.job == "worker" else 0)
        del server_config.device_filters[:]
        try:
            server = tf.distribute.Server(cluster, job_name=args.job, task_index=args.task,
                                          config=server_config, start=True)
        except (tf.errors.UnknownError, tf.errors.InternalError) as e:
            # gRPC reports a taken port as "Could not start gRPC server".
            message = str(e).lower()
            if any(m in message for m in ("address already in use", "failed to bind",
                                          "could not start grpc server")):
                print(f"port taken: {e}", file=sys.stderr)
                return EXIT_PORT_IN_USE
            raise
        flag = job.ready_flag(args.job, args.task)
        flag.write_text(str(os.getpid()))
        if args.job == "ps":
            while True:  # served until the launcher stops this process
                time.sleep(3600)
        _wait_for_cluster(job, spec, config.startup_timeout_s)
        run_worker(job, args.task, server.target)
        return 0
    except Exception:  # pylint: disable=broad-except
        traceback.print_exc()
        return EXIT_FAILED


def _exit_with_parent(parent_pid: int, period_s: float = 1.0) -> None:
    """Ends this task if the launcher dies without stopping it (e.g. SIGKILL)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(EXIT_FAILED)  # pylint: disable=protected-access
            time.sleep(period_s)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _wait_for_cluster(job, spec, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    flags = [job.ready_flag(*spec.task_of(i)) for i in range(len(spec.nodes))]
    while not all(f.exists() for f in flags):
        if time.monotonic() > deadline:
            missing = [f.name for f in flags if not f.exists()]
            raise TimeoutError(f"tasks {missing} did not start within {timeout_s}s")
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
