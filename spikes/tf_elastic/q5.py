"""Q5: PS synchronous step; chief blocked in take_grad(3) when a worker dies."""
import signal
import time

from builders import DEF
from common import Cluster, show

SYNC = r'''
def b_sync(ver, need):
    v, vi = ps_var("w")
    with tf.device("/job:ps/task:0/device:CPU:0"):
        acc = tf.compat.v1.ConditionalAccumulator(tf.float32, shape=[], shared_name=f"acc_v{ver}",
                                                  name=f"acc_v{ver}")
        num = acc.num_accumulated()
    ls = tf.compat.v1.placeholder_with_default(tf.constant(0, tf.int64), [], name="local_step")
    push = acc.apply_grad(tf.constant(float(task + 1)), local_step=ls)
    with tf.control_dependencies([push]):
        take = acc.take_grad(need)
    upd = v.assign_add(take * need)   # mean * count = sum
    drain = acc.take_grad(1)
    return dict(ls=ls, v=v.read_value(), init=v.initializer, push=push, step=upd, num=num, drain=drain,
                take_only=v.assign_add(acc.take_grad(need) * need))
'''
PSF = '["/job:ps", f"/job:worker/task:{task}"]'
c = Cluster("q5", workers=4, ps=1)
try:
    c.start(["ps0", "w0", "w1", "w2"])
    c.call_all({n: DEF + SYNC for n in ["w0", "w1", "w2"]})
    show("sessions v0 (acc_v0, need 3)", c.call_all(
        {n: f"F = new_session(lambda: b_sync(0, 3), filters={PSF})" for n in ["w0", "w1", "w2"]}))
    c.tasks["w0"].call("run(F['init'])")
    show("round 1: w1,w2 push", c.call_all({n: "R = run(F['push'], feed={F['ls']: 0})" for n in ["w1", "w2"]}))
    show("round 1: chief push+take(3)", c.tasks["w0"].call("R = float(run(F['step'], feed={F['ls']: 0})); R = float(run(F['v']))"))
    show("round 2: w1 push", c.tasks["w1"].call("R = run(F['push'], feed={F['ls']: 1})"))
    c.tasks["w0"].send("t = time.time(); R = loop(F['step'], 1, timeout_ms=10000, feed={F['ls']: 1}); R['dt'] = time.time() - t")
    time.sleep(1.0)
    t_kill = time.time()
    c.tasks["w2"].kill(signal.SIGKILL)
    r = c.tasks["w0"].recv(60)
    show("round 2: chief blocked in take_grad(3), w2 SIGKILLed 1 s after", r)
    if r.get("ok") and "t_err" in r["R"]:
        print(f"   error {r['R']['t_err'] - t_kill:.2f}s after SIGKILL, {r['R']['dt']:.2f}s after the run began")
    show("after: num_accumulated (same session)", c.tasks["w0"].call("R = int(run(F['num']))"))
    show("ghost taker? w1 pushes once more, then num_accumulated",
         c.tasks["w1"].call("run(F['push'], feed={F['ls']: 1}); R = int(run(F['num']))"))
    show("chief new session (same acc_v0): num_accumulated, v", c.tasks["w0"].call(
        f"F = new_session(lambda: b_sync(0, 2), filters={PSF}); R = [int(run(F['num'])), float(run(F['v']))]"))
    show("drain acc_v0 with take_grad(1), then num", c.tasks["w0"].call(
        "d = float(run(F['drain'])); R = [d, int(run(F['num']))]"))
    show("membership v1 (w0,w1), new accumulator acc_v1 need 2", c.call_all(
        {n: f"F = new_session(lambda: b_sync(1, 2), filters={PSF})" for n in ["w0", "w1"]}))
    c.tasks["w1"].call("run(F['push'], feed={F['ls']: 0})")
    show("v1 round: chief push+take(2) -> v (expect previous + 1 + 2)",
         c.tasks["w0"].call("run(F['step'], feed={F['ls']: 0}); R = float(run(F['v']))"))
finally:
    c.close()
