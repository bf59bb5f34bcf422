"""One TF server process (worker or PS) with a command loop for the spike.

argv: cluster_json job task [cluster_json_for_server]
Reads JSON lines {"code": str} on stdin, execs them in a persistent namespace
(tf, server, helpers), answers '@@R {json}' on stdout: ok, R (value of R),
type/msg on error, t0/t1 wall-clock times.
"""
import json
import os
import sys
import time

cluster = json.loads(sys.argv[1])
job, task = sys.argv[2], int(sys.argv[3])
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

LEADER = "/job:worker/replica:0/task:0"
cfg = tf.compat.v1.ConfigProto()
cfg.experimental.collective_group_leader = LEADER
server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=task,
                              config=cfg, start=True)
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # anything TF prints goes to the log, not the protocol
ns = {"tf": tf, "np": np, "server": server, "time": time, "job": job, "task": task,
      "LEADER": LEADER, "cluster": cluster}
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers.py")) as f:
    exec(f.read(), ns)
out.write("@@READY\n")
out.flush()
if job == "ps":
    server.join()
for line in sys.stdin:
    msg = json.loads(line)
    ns["R"] = None
    t0 = time.time()
    try:
        exec(msg["code"], ns)
        res = {"ok": True, "R": ns.get("R")}
    except Exception as e:  # noqa: BLE001 - the spike reports every error
        res = {"ok": False, "type": type(e).__name__, "msg": str(e).strip()[:700]}
    res["t0"], res["t1"] = t0, time.time()
    out.write("@@R " + json.dumps(res, default=str) + "\n")
    out.flush()
