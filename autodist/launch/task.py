"""What one task process does around its work: server, job, watchdogs, exit codes.

`main(argv, run_worker)` is the whole life of a task process; the process's
module (``python -m autodist.runtime.entry``, see `autodist.runtime.entry`)
calls it with the worker loop, so this layer starts servers and moves jobs
without knowing how training works. Two ways to start a task:

    # A task of a local cluster, or the chief of a multi-host run: the driver
    # starts it on its own host with the job directory it wrote.
    python -m autodist.runtime.entry --job-dir DIR --job worker --task 0

    # A task on another host (what `autodist serve` runs, once per job): reads
    # the cluster and its own task from TF_CONFIG (or a resource-spec file),
    # starts its server, and waits for the chief to ship it the job over
    # TensorFlow. It needs neither the user's script nor a shared filesystem.
    python -m autodist.runtime.entry --tf-config [--job-timeout 600] [--work-dir DIR]
        [--secret-file FILE | --insecure]
    python -m autodist.runtime.entry --cluster cluster.yml --task worker:1

A serving task runs only a job signed with the cluster's secret
(`autodist.launch.signing`; ``--secret-file``, ``AUTODIST_SECRET_FILE`` or
``AUTODIST_SECRET``), or, with ``--insecure`` and no secret, any job. A job
arrives in chunks (`autodist.launch.chunks`): the task verifies each before
keeping it and the whole before unpacking it; a chunk or job that fails is
logged as a `JobRejectedError` (the job id and task it claimed, and what was
wrong) and answered with a receipt saying so, and the task waits for the
next job within its job timeout. Every task process creates its files 0600
and its directories 0700 (umask 077).

A worker trains; a parameter-server task serves until the launcher stops it
(local cluster) or the chief says the job is done (shipped job). Exit codes:
0 done, 1 failed (traceback on stderr, i.e. in the log), 3 the port was taken
(a local launcher retries with other ports), 4 no job arrived in time.
"""
from __future__ import annotations

import argparse
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable

from autodist.launch import heartbeats
from autodist.launch.chunks import Receiver
from autodist.launch.errors import (EXIT_FAILED, EXIT_NO_JOB, EXIT_PORT_IN_USE, JobMismatchError,
                                    unreachable_peer)
from autodist.launch.job import JobDir
from autodist.launch.signing import JobRejectedError

logger = logging.getLogger(__name__)

# The work of a worker task: (its job, its task index, its server's target).
RunWorker = Callable[[JobDir, int, str], None]
# Checks a received job as the runtime reads it (its config), before it is accepted.
CheckJob = Callable[[JobDir], object]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job-dir", help="the job directory (a task the driver starts)")
    parser.add_argument("--job", choices=("worker", "ps"), help="with --job-dir")
    parser.add_argument("--task", help="with --job-dir: the task index; with --cluster: "
                                       "JOB:INDEX, e.g. worker:1")
    parser.add_argument("--tf-config", action="store_true",
                        help="serve a shipped job as the task that the TF_CONFIG environment "
                             "variable names")
    parser.add_argument("--cluster", help="serve a shipped job as --task of this resource-spec "
                                          "YAML file")
    parser.add_argument("--gpus-per-worker", type=int, default=None,
                        help="with --tf-config: GPUs of each worker (default: those this host "
                             "shows, as ResourceSpec.from_tf_config counts them)")
    parser.add_argument("--cpu-replicas-per-worker", type=int, default=1,
                        help="with --tf-config: replicas of each worker on logical CPU devices "
                             "(default 1)")
    parser.add_argument("--job-timeout", type=float, default=600.0,
                        help="seconds to wait for the job to arrive (default 600)")
    parser.add_argument("--work-dir", help="where to unpack the shipped job (default: a new "
                                           "temporary directory, removed after success)")
    parser.add_argument("--parent-pid", type=int, default=0,
                        help="exit when this process (the launcher) is gone")
    parser.add_argument("--secret-file",
                        help="serving: the cluster's shared secret (default: the file named by "
                             "AUTODIST_SECRET_FILE, else AUTODIST_SECRET)")
    parser.add_argument("--insecure", action="store_true",
                        help="serving without a secret: run any job (trusted networks only)")
    return parser


def main(argv: list[str] | None, run_worker: RunWorker,
         check_job: CheckJob | None = None) -> int:
    """Runs one task process to its end; returns its exit code.

    Args:
        argv: The command line (see `build_parser`); None reads `sys.argv`.
        run_worker: What a worker task does once its server is up and its
            job is here.
        check_job: Serving: reads a received job as the runtime will (raises
            on a config it cannot run), so such a job is rejected with a
            receipt and the task serves on, before it is accepted.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    serving = args.tf_config or args.cluster
    if serving and args.job_dir:
        parser.error("--job-dir is for tasks the driver starts; --tf-config / --cluster serve "
                     "a shipped job: give one or the other")
    if not serving and (args.job_dir is None or args.job is None or args.task is None):
        parser.error("give --job-dir, --job and --task, or --tf-config, or --cluster and --task")
    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    os.umask(0o077)  # what this process creates (results, checkpoints, ...): 0600, dirs 0700
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return _serve(args, run_worker, check_job or (lambda job: None)) if serving \
            else _run_local(args, run_worker)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # Not a normal exit: closing a session whose peer stopped answering
        # (the likely cause of the failure) would wait for it forever.
        os._exit(EXIT_FAILED)


def _run_local(args: argparse.Namespace, run_worker: RunWorker) -> int:
    """A task whose job directory the driver wrote on this host."""
    from autodist.launch.server import start_server

    job = JobDir(args.job_dir)
    task = int(args.task)
    spec = job.resource_spec()
    # The launcher set this task's environment for its GPUs (`launch.devices`).
    server = start_server(spec.cluster_def(job.ports()), args.job, task,
                          spec.task_devices(spec.node_of_task(args.job, task)))
    if server is None:
        return EXIT_PORT_IN_USE
    job.ready_flag(args.job, task).write_text(str(os.getpid()))
    heartbeats.start(job.heartbeat(args.job, task))  # the launcher's hang detection
    if args.job == "ps":
        while True:  # served until the launcher stops this process
            time.sleep(3600)
    try:
        run_worker(job, task, server.target)
    except Exception as e:
        peer = unreachable_peer(e)
        if peer is not None:  # the driver tells a restarted peer from a bug by it
            job.unreachable_peer(args.job, task).write_text(peer)
        raise
    return 0


def _serve(args: argparse.Namespace, run_worker: RunWorker, check_job: CheckJob) -> int:
    """A task on its own host: waits for the chief to ship the job, then runs it."""
    from autodist.ir.gpus import visible_gpus
    from autodist.launch import mailbox, tf_config
    from autodist.launch.devices import task_environment
    from autodist.launch.server import start_server

    secret = serving_secret(args.secret_file, args.insecure)
    spec, (job_name, task) = (
        tf_config.task_from_tf_config(gpus_per_worker=args.gpus_per_worker,
                                      cpu_replicas_per_worker=args.cpu_replicas_per_worker)
        if args.tf_config else tf_config.task_from_spec_file(args.cluster, args.task))
    cluster = spec.cluster_def()
    devices = spec.task_devices(spec.node_of_task(job_name, task))
    # Before TensorFlow starts CUDA (in start_server): only this node's GPUs.
    os.environ.update(task_environment(devices, visible_gpus() if devices.gpus else [],
                                       f"task {job_name}:{task}"))
    server = start_server(cluster, job_name, task, devices)
    if server is None:
        return EXIT_PORT_IN_USE
    mail = mailbox.Mailboxes(cluster)
    own = (job_name, task)
    name = f"{job_name}:{task}"
    address = mail.address(own)
    print(f"autodist: task {name} serving at {address}; waiting up to {args.job_timeout:g}s "
          f"for a job" + ("" if secret else " (insecure: unsigned jobs accepted)"), flush=True)
    deadline = time.monotonic() + args.job_timeout
    parent = pathlib.Path(args.work_dir) if args.work_dir else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    receiver = Receiver(parent)
    try:
        while True:
            try:
                message = mail.receive(own, mailbox.JOB, max(deadline - time.monotonic(), 0.001))
            except mailbox.MailboxTimeout:
                pending = receiver.pending()
                print(f"autodist: error: no job arrived for task {name} at {address} within "
                      f"{args.job_timeout:g}s"
                      + (f" (an unfinished one: {pending})" if pending else "") + ". The chief "
                      "ships it when `fit` starts in the user's script on worker 0 "
                      "(launch='remote', the same cluster).", file=sys.stderr, flush=True)
                return EXIT_NO_JOB
            received = _accept(message, receiver, secret, name, cluster, own, devices, parent,
                               check_job)
            del message
            if received is not None:
                job_id, how, job, work, config = received
                break
    finally:
        receiver.discard()
    mail.close_box(own, mailbox.JOB)  # one job per process: a later sender retries
    _send_receipt(cluster, own, job_id, mailbox.ACCEPTED)
    print(f"autodist: task {name} received a job ({how}) into {work}", flush=True)
    _exit_on_abort(cluster, own, config.job_id, config.job_timeout_s)
    if job_name == "worker":
        run_worker(job, task, server.target)
    else:
        job_mail = mailbox.Mailboxes(cluster, job_id=config.job_id)
        job_mail.receive(own, mailbox.DONE, config.job_timeout_s)
    print(f"autodist: task {name} done", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _accept(message: bytes, receiver: Receiver, secret: bytes | None, name: str, cluster,
            own, devices, parent: pathlib.Path | None, check_job: CheckJob):
    """A received job chunk verified and kept; once the job is complete, the job unpacked
    and checked: (job id, how it came, job, its directory, config). None while chunks
    are missing, and after a rejection receipt, whatever was wrong (the task then waits for
    the next job: nothing a peer sends may end it)."""
    from autodist.launch import signing
    from autodist.launch.devices import check_shipped_devices

    job_id, work = "", None
    try:
        part = signing.unseal_part(message, secret, name, time.time())
        job_id = part.job_id
        archive = receiver.add(part)
        if archive is None:
            return None   # more chunks to come
        work = pathlib.Path(tempfile.mkdtemp(prefix="autodist-job-", dir=parent))
        job = JobDir.unpack(archive, work)
        receiver.discard()   # unpacked: the archive's file goes
        config = job.settings()
        shipped_spec = job.resource_spec()
        shipped = shipped_spec.cluster_def(job.ports())
        if config.job_id != job_id:
            raise JobMismatchError(f"the job's config names job {config.job_id!r}, its seal "
                                   f"{job_id!r}")
        if shipped != cluster:
            raise JobMismatchError(f"the chief's cluster {shipped} is not this task's cluster "
                                   f"{cluster}; give every task the same TF_CONFIG cluster "
                                   "(or spec file)")
        check_shipped_devices(shipped_spec, own[0], own[1], devices)
        check_job(job)
        how = (f"{part.total} bytes in {part.count} chunk{'s' if part.count != 1 else ''}, "
               f"message format v{part.version}")
        return job_id, how, job, work, config
    except JobRejectedError as e:
        kind, reason, job_id = "JobRejectedError", e.reason, e.job_id
    except Exception as e:  # noqa: BLE001  # a job this task cannot run
        kind, reason = type(e).__name__, f"{type(e).__name__}: {str(e)[:500]}"
    logger.error("%s: task %s rejected a job (claimed job id %r): %s; waiting for the next job",
                 kind, name, job_id, reason)
    receiver.discard(job_id)   # what was kept of that job: it will not run
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
    _send_receipt(cluster, own, job_id, f"rejected: {reason}".encode())
    return None


def serving_secret(secret_file: str | None, insecure: bool) -> bytes | None:
    """The secret a serving task verifies jobs with (None: `insecure`, any job runs).

    Raises:
        SecretError: the secret cannot be read, or there is none and not
            `insecure`, or both.
    """
    from autodist.launch import signing

    secret = signing.load_secret(secret_file)
    if secret is None and not insecure:
        raise signing.SecretError(
            "a serving task runs only jobs signed with the cluster's shared secret, and none "
            f"was given: pass --secret-file FILE, or set {signing.SECRET_FILE_ENV} (a file, "
            f"e.g. a mounted Kubernetes secret) or {signing.SECRET_ENV}, with the same secret "
            "for the chief; or, on a trusted network only, --insecure")
    if secret is not None and insecure:
        raise signing.SecretError("--insecure serves without a secret, but a secret was given "
                                  f"(--secret-file, {signing.SECRET_FILE_ENV} or "
                                  f"{signing.SECRET_ENV}): give one or the other")
    return secret


def _send_receipt(cluster: dict[str, list[str]], own: tuple[str, int], job_id: str,
                  receipt: bytes) -> None:
    """Tells the chief (through this task's own receipt box) what became of its job."""
    from autodist.launch import mailbox

    if not job_id:
        return  # the chief tags its receipts with its job id: none to answer
    mail = mailbox.Mailboxes(cluster, job_id=job_id)
    try:
        mail.send(own, mailbox.RECEIPT, receipt, timeout_s=10.0)
    except mailbox.MailboxError as e:
        logger.warning("could not leave a receipt for job %r: %s", job_id, e)
    finally:
        mail.close()


def _exit_on_abort(cluster: dict[str, list[str]], own: tuple[str, int], job_id: str,
                   timeout_s: float) -> None:
    """Ends this process as soon as the driver says its job failed.

    So a failed job frees the task (and its port) for the next one at once,
    instead of when its own timeouts expire.
    """
    from autodist.launch import mailbox

    def watch() -> None:
        mail = mailbox.Mailboxes(cluster, job_id=job_id)  # its own sessions: not thread-shared
        try:
            mail.receive(own, mailbox.ABORT, timeout_s)
        except mailbox.MailboxError:
            return
        print(f"autodist: task {own[0]}:{own[1]}: the driver aborted the job", file=sys.stderr,
              flush=True)
        os._exit(EXIT_FAILED)

    threading.Thread(target=watch, name="abort-watch", daemon=True).start()


def _exit_with_parent(parent_pid: int, period_s: float = 1.0) -> None:
    """Ends this task if the launcher dies without stopping it (e.g. SIGKILL)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(EXIT_FAILED)
            time.sleep(period_s)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
