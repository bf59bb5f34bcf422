"""ClusterSpec propagation: sessions whose ConfigProto.cluster_def differs from the servers'."""
import json

from builders import DEF
from common import Cluster, free_ports, show

c = Cluster("qcd", workers=4, ps=1)
try:
    c5 = {"worker": c.spec["worker"] + [f"localhost:{free_ports(1)[0]}"], "ps": c.spec["ps"]}
    c.start(["ps0", "w0", "w1"])
    c.start(["w4"], server_cluster=c5)
    C5 = json.dumps(c5)
    c.call_all({n: DEF for n in ["w0", "w1", "w4"]})
    show("w0 normal session: init PS var, one update", c.tasks["w0"].call(
        "F = new_session(b_ps, filters=['/job:ps', '/job:worker/task:0']); run(F['init_v']); R = float(run(F['upd']))"))
    for iso in (False, True):
        show(f"w0 session cluster_def=5 slots, isolate_session_state={iso}: PS var initialized? value", c.tasks["w0"].call(
            f"F = new_session(b_ps, filters=['/job:ps', '/job:worker/task:0'], cluster_def={C5}, isolate={iso}); "
            "vi = bool(run(F['vi'])); R = [vi, float(run(F['v'])) if vi else None]"))
    show("w4 (started with the 5-slot spec) session on its own server: PS var?", c.tasks["w4"].call(
        "F = new_session(b_ps, filters=['/job:ps', '/job:worker/task:4']); "
        "vi = bool(run(F['vi'])); R = [vi, float(run(F['v'])) if vi else None]"))
    show("w4 pushes a value computed on w4 into the PS var (PS must reach w4)", c.tasks["w4"].call(
        "def b():\n d = b_ps()\n with tf.device(me()):\n  g = tf.constant(5.0) * tf.constant(2.0)\n"
        " d['push'] = tf.raw_ops.AssignAddVariableOp(resource=d['vh'], value=g)\n return d\n"
        "F = new_session(b, filters=['/job:ps', '/job:worker/task:4']); run(F['push'], timeout_ms=10000); R = float(run(F['v']))"))
    f3p = "['/job:ps', '/job:worker/task:0', '/job:worker/task:1', '/job:worker/task:4']"
    code = "F = new_session(lambda: coll(3, 6, 1, tag=6), filters=FF); R = run(F).tolist()"
    show("collective gs3 over w0,w1 (4-slot servers) and w4 (5-slot server), plain sessions (w0,w1 filters without task 4)",
         c.call_all({"w0": code.replace("FF", "['/job:ps', '/job:worker/task:0', '/job:worker/task:1']"),
                     "w1": code.replace("FF", "['/job:ps', '/job:worker/task:0', '/job:worker/task:1']"),
                     "w4": code.replace("FF", f3p)}, 60))
finally:
    c.close()
