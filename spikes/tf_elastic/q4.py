"""Q4: SIGKILL a worker while the others loop in collective steps; can survivors recover?"""
import signal
import time

from builders import DEF
from common import Cluster, show

F2 = '["/job:ps", "/job:worker/task:0", "/job:worker/task:1"]'
F3 = '["/job:ps", "/job:worker/task:0", "/job:worker/task:1", "/job:worker/task:2"]'
S = ["w0", "w1"]
c = Cluster("q4", workers=4, ps=1)
try:
    c.start(["ps0", "w0", "w1", "w2"])
    c.call_all({n: DEF for n in ["w0", "w1", "w2"]})
    show("PS var init (w0)", c.tasks["w0"].call(
        f"F = new_session(b_ps, filters={F2[:-1]}]); run(F['init_v']); R = run(F['upd'])"))
    code = f"F = new_session(lambda: coll(3, 1, 1, tag=1), filters={F3}); R = run(F).tolist()"
    show("warm-up gs3", c.call_all({n: code for n in ["w0", "w1", "w2"]}, 60))
    for n in ["w0", "w1", "w2"]:
        c.tasks[n].send("R = loop(F, 40, timeout_ms=10000)")
    time.sleep(3)
    t_kill = time.time()
    c.tasks["w2"].kill(signal.SIGKILL)
    res = {n: c.tasks[n].recv(60) for n in S}
    show("loop results (survivors)", res)
    for n, r in res.items():
        if r.get("ok") and "t_err" in r["R"]:
            print(f"   {n}: error {r['R']['t_err'] - t_kill:.2f}s after SIGKILL")

    def attempt(label, code, names=S):
        r = c.call_all({n: code for n in names}, 60)
        show(label, r)
        return all(x.get("ok") for x in r.values())

    base = "lambda: coll(2, {k}, 1, tag={k})"
    attempt("R0 survivors: PS-only step in a new session (no collective)",
            f"F = new_session(b_ps, filters={F2}); R = [run(F['upd']) for _ in range(2)]")
    attempt("R1 new graph+session, gs2 new key 10, new graph key tag 10",
            f"F = new_session({base.format(k=10)}, filters={F2}); R = run(F).tolist()") or \
        attempt("R2 + isolate_session_state=True, key 11",
                f"F = new_session({base.format(k=11)}, filters={F2}, isolate=True); R = run(F).tolist()") or \
        attempt("R3 + session collective_group_leader=task:1, key 12",
                f"F = new_session({base.format(k=12)}, filters={F2}, leader='/job:worker/replica:0/task:1'); R = run(F).tolist()") or \
        attempt("R4 Session.reset(server.target) then new session, key 13",
                "SESS.close(); SESS = None; tf.compat.v1.Session.reset(server.target, containers=['spike_none'], config=make_config(filters=" + F2 + ")); "
                f"F = new_session({base.format(k=13)}, filters={F2}); R = run(F).tolist()")
    # Fallback: restart the survivors in the same slots; the PS keeps its state.
    c.tasks["w0"].kill()
    c.tasks["w1"].kill()
    t0 = time.time()
    ok = True
    for attempt_i in range(10):
        try:
            dt = c.start(["w0", "w1"])
            break
        except AssertionError as e:
            print("restart failed", e)
            time.sleep(1)
    show("restart w0,w1 in the same slots (ports)", {"s": time.time() - t0})
    c.call_all({n: DEF for n in S})
    attempt("after restart: gs2 key 20 + PS var value",
            f"F = new_session(lambda: (coll(2, 20, 1, tag=20), b_ps()), filters={F2}); "
            "r = run(F[0]); R = [r.tolist(), bool(run(F[1]['vi'])), float(run(F[1]['v']))]")
finally:
    c.close()
