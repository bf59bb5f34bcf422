"""Q6: rebuild (new graph from a ~1000-op GraphDef + session + first step) vs fresh processes."""
import time

from builders import DEF
from common import Cluster, show

BIG = r'''
def make_gd(n=200):
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder_with_default(tf.ones([64]), [64], name="x")
        for _ in range(n):
            x = tf.tanh(x * 0.99 + 0.01)
        tf.identity(tf.reduce_sum(x), name="out")
    return g.as_graph_def()


def rebuild(version, members):
    """New graph: import the GraphDef on this task, PS update, all-reduce of its output."""
    t = {"start": time.time()}
    def b():
        with tf.device(me()):
            out, = tf.graph_util.import_graph_def(GD, return_elements=["out:0"], name="step")
        d = b_ps()
        with tf.device(me()):
            red = coll(len(members), 100 + version, 1, value=None, tag=100 + version)
            red = red + tf.reshape(out, [1]) * 0.0
        d["red"] = red
        return d
    F = new_session(b, filters=["/job:ps"] + [f"/job:worker/task:{m}" for m in members])
    t["built"] = time.time()
    r = run([F["red"], F["upd"]])
    t["first_step"] = time.time()
    return dict(nodes=len(G.as_graph_def().node), build_s=t["built"] - t["start"],
                first_step_s=t["first_step"] - t["built"], total_s=t["first_step"] - t["start"],
                red=r[0].tolist())
'''
W = ["w0", "w1", "w2"]
c = Cluster("q6", workers=4, ps=1)
try:
    show("start ps0 + 3 workers (4 processes)", {"s": c.start(["ps0"] + W)})
    c.call_all({n: DEF + BIG + "\nGD = make_gd()\nR = len(GD.node)" for n in W})
    c.tasks["w0"].call("F = new_session(b_ps, filters=['/job:ps', '/job:worker/task:0']); run(F['init_v'])")
    for v in (1, 2, 3):
        t0 = time.time()
        r = c.call_all({n: f"R = rebuild({v}, [0, 1, 2])" for n in W}, 120)
        show(f"rebuild v{v} (driver wall {time.time() - t0:.2f}s)", r)
    t0 = time.time()
    r = c.call_all({n: "R = rebuild(4, [0, 1])" for n in W[:2]}, 120)
    show(f"rebuild v4 shrink to w0,w1 (driver wall {time.time() - t0:.2f}s)", r)
    for n in W:
        c.tasks[n].kill()
    t0 = time.time()
    dt_start = c.start(W)
    c.call_all({n: DEF + BIG + "\nGD = make_gd()" for n in W})
    t1 = time.time()
    r = c.call_all({n: "R = rebuild(5, [0, 1, 2])" for n in W}, 120)
    t2 = time.time()
    show(f"fresh: start 3 worker processes {dt_start:.2f}s, +make GraphDef {t1 - t0:.2f}s, "
         f"+session+first step {t2 - t1:.2f}s: total {t2 - t0:.2f}s", r)
finally:
    c.close()
