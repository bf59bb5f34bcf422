"""Mailboxes against real TensorFlow servers in other processes."""
from __future__ import annotations

import subprocess
import sys

import pytest

from autodist.launch import mailbox
from autodist.launch.local import free_ports

pytestmark = pytest.mark.cluster

_SERVER = ("import sys, tensorflow as tf; tf.distribute.Server(tf.train.ClusterSpec("
           "{'worker': [sys.argv[1]]}), job_name='worker', task_index=0).join()")


def _server(address: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _SERVER, address],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def test_a_task_whose_server_restarted_is_reached_again():
    """A served task runs each job in a fresh process on its port: a session made on the
    last job's server is gone on the next one ("Session ... is not found"). The driver
    must make a new session there, not fail (CI saw the second job of a measured search
    fail so)."""
    address = f"127.0.0.1:{free_ports(1)[0]}"
    task = ("worker", 0)
    mail = mailbox.Mailboxes({"worker": [address]}, job_id="cafe01")
    servers = [_server(address)]
    try:
        mail.wait_until_up([task], 60)
        mail.send(task, mailbox.JOB, b"first", 10)
        servers[0].kill()
        servers[0].wait(timeout=30)
        servers.append(_server(address))
        mail.wait_until_up([task], 60)   # the old session is gone: a new one
        assert mail.waiting(task, mailbox.JOB) == 0   # a fresh server's boxes are empty
        mail.send(task, mailbox.JOB, b"second", 10)
        assert mail.receive(task, mailbox.JOB, 10) == b"second"
    finally:
        mail.close()
        for server in servers:
            server.kill()
            server.wait(timeout=30)
