"""Driver side: start task processes on loopback, send them code, kill them."""
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

PY = "/opt/adenv/bin/python"
HERE = os.path.dirname(os.path.abspath(__file__))
LOGS = os.path.join(HERE, "logs")


def free_ports(n):
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def make_cluster(workers=4, ps=1):
    ports = free_ports(workers + ps)
    return {"worker": [f"localhost:{p}" for p in ports[:workers]],
            "ps": [f"localhost:{p}" for p in ports[workers:]]}


class Task:
    def __init__(self, cluster, job, index, tag, server_cluster=None):
        self.name = f"{job}{index}"
        log = open(os.path.join(LOGS, f"{tag}_{self.name}.log"), "w")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0")
        self.proc = subprocess.Popen(
            [PY, os.path.join(HERE, "task.py"), json.dumps(server_cluster or cluster), job,
             str(index)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            text=True, env=env)
        self.q = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("@@READY"):
                self.q.put("READY")
            elif line.startswith("@@R "):
                self.q.put(json.loads(line[4:]))
        self.q.put({"ok": False, "type": "EOF", "msg": "process ended"})

    def wait_ready(self, timeout=120):
        got = self.q.get(timeout=timeout)
        assert got == "READY", got

    def send(self, code):
        self.proc.stdin.write(json.dumps({"code": code}) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout=60):
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            return {"ok": False, "type": "DRIVER_TIMEOUT", "msg": f"no answer in {timeout}s"}

    def call(self, code, timeout=60):
        self.send(code)
        return self.recv(timeout)

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)


class Cluster:
    def __init__(self, tag, workers=4, ps=1):
        self.tag = tag
        self.spec = make_cluster(workers, ps)
        self.tasks = {}

    def start(self, names, server_cluster=None):
        t0 = time.time()
        for n in names:
            job, idx = ("ps", int(n[2:])) if n.startswith("ps") else ("worker", int(n[1:]))
            self.tasks[n] = Task(self.spec, job, idx, self.tag, server_cluster)
        for n in names:
            self.tasks[n].wait_ready()
        return time.time() - t0

    def call_all(self, codes, timeout=60):
        """codes: {name: code}; sent to all first, then all answers collected."""
        for n, c in codes.items():
            self.tasks[n].send(c)
        deadline = time.time() + timeout
        return {n: self.tasks[n].recv(max(1, deadline - time.time())) for n in codes}

    def close(self):
        for t in self.tasks.values():
            try:
                t.kill()
            except Exception as e:  # noqa: BLE001
                print("kill failed", t.name, e)


def show(label, res):
    print(f"== {label}")
    if isinstance(res, dict) and "ok" not in res:
        for n, r in res.items():
            print(f"   {n}: {fmt(r)}")
    else:
        print(f"   {fmt(res)}")
    sys.stdout.flush()


def fmt(r):
    if not isinstance(r, dict):
        return f"{r:.2f}s" if isinstance(r, float) else str(r)
    dt = r.get("t1", 0) - r.get("t0", 0)
    if r.get("ok"):
        return f"OK {dt:.2f}s R={r.get('R')}"
    return f"ERR {dt:.2f}s {r.get('type')}: {short(r.get('msg') or '')}"


def short(msg):
    """The error's own lines, without Python stack traces."""
    keep, skip = [], False
    for line in msg.splitlines():
        s = line.strip()
        if not s:
            continue
        if s.startswith(("Detected at node", "Original stack trace")):
            skip = True
            continue
        if s.startswith("Node:") or s.startswith("From /job"):
            skip = False
        if skip or s.startswith("File ") or s.startswith("The error could be") \
                or s.startswith("[[{{node"):
            continue
        keep.append(s)
    return " | ".join(keep)[:500]
