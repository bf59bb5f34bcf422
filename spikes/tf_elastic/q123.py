"""Q1-Q3: pre-declared slots, grow 2->3 with new sessions, shrink to 1, kill idle."""
import signal
import sys
import time

from builders import DEF
from common import Cluster, show

PSF = '["/job:ps", f"/job:worker/task:{task}"]'
c = Cluster("q123", workers=4, ps=1)
try:
    print("cluster", c.spec)
    show("start ps0,w0,w1 (slots w2,w3 absent)", {"s": c.start(["ps0", "w0", "w1"])})
    c.call_all({n: DEF for n in ["w0", "w1"]})
    # Q1a PS step, filters ps+self
    show("Q1a w0 session+init", c.tasks["w0"].call(
        f"F = new_session(b_ps, filters={PSF}); run(F['init_v']); run(F['init_l']); R = run(F['upd'])"))
    show("Q1a w1 session+init local", c.tasks["w1"].call(
        f"F = new_session(b_ps, filters={PSF}); run(F['init_l']); R = run(F['upd'])"))
    show("Q1a both step", c.call_all({n: "R = run([F['upd'], F['lupd']])" for n in ["w0", "w1"]}))
    show("Q1a read", c.call_all({n: "R = run([F['v'], F['l']])" for n in ["w0", "w1"]}))
    # Q1b collective size 2 with filters ps,w0,w1
    code = ('F = new_session(lambda: coll(2, 1, 1), filters=["/job:ps", "/job:worker/task:0", '
            '"/job:worker/task:1"]); R = [run(F).tolist() for _ in range(3)]')
    show("Q1b coll gs2 key1 filters ps,w0,w1", c.call_all({n: code for n in ["w0", "w1"]}, 90))
    if "--q1" in sys.argv:
        code = 'F = new_session(lambda: coll(2, 11, 1)); R = [run(F).tolist() for _ in range(3)]'
        show("Q1b coll gs2 key11 NO filters", c.call_all({n: code for n in ["w0", "w1"]}, 90))
        sys.exit(0)

    # Q2 grow
    show("Q2 start w2", {"s": c.start(["w2"])})
    c.call_all({"w2": DEF})
    code = (f"F = new_session(b_ps, filters={PSF}); vi, li = run([F['vi'], F['li']]); "
            "R = dict(ps_init=bool(vi), ps_v=float(run(F['v'])) if vi else None, "
            "local_init=bool(li), local_v=float(run(F['l'])) if li else None)")
    show("Q2 new graph+session, PS var + local var state", c.call_all({n: code for n in ["w0", "w1", "w2"]}))
    filt3 = '["/job:ps", "/job:worker/task:0", "/job:worker/task:1", "/job:worker/task:2"]'
    code = f"F = new_session(lambda: coll(3, 2, 1), filters={filt3}); R = [run(F).tolist() for _ in range(3)]"
    show("Q2 coll gs3 NEW key 2", c.call_all({n: code for n in ["w0", "w1", "w2"]}, 90))

    # Q3 shrink to w0
    show("Q3 w1,w2 close sessions", c.call_all({n: "SESS.close(); SESS = None" for n in ["w1", "w2"]}))
    code = (f"F = new_session(b_ps, filters={PSF}); R = [float(run(F['v'])), "
            "[run(F['upd']) for _ in range(3)] and float(run(F['v']))]")
    show("Q3 w0 alone PS step (filters ps,w0)", c.tasks["w0"].call(code))
    code = ('def b():\n d = b_ps(); d["c"] = coll(1, 4, 1); return d\n'
            f'F = new_session(b, filters={PSF}); R = [run([F["upd"], F["c"]])[1].tolist() for _ in range(3)]')
    show("Q3 w0 alone PS step + coll gs1 key4", c.tasks["w0"].call(code))
    c.tasks["w2"].kill(signal.SIGKILL)
    print("killed w2 at", time.time())
    show("Q3 w0 same session after w2 SIGKILL", c.tasks["w0"].call(
        'R = [run([F["upd"], F["c"]])[1].tolist() for _ in range(3)]'))
    show("Q3 w0 new session after w2 SIGKILL", c.tasks["w0"].call(
        f'F = new_session(b, filters={PSF}); R = [run([F["upd"], F["c"]])[1].tolist(), float(run(F["v"]))]'))
    # Untagged, this times out (step-id sequences out of step: see q3b.py D); tagged it works.
    show("Q3 w0+w1 back to gs2 new key 5 + graph-key tag 5, filters ps,w0,w1", c.call_all({n: (
        'F = new_session(lambda: coll(2, 5, 1, tag=5), filters=["/job:ps", "/job:worker/task:0", '
        '"/job:worker/task:1"]); R = run(F).tolist()') for n in ["w0", "w1"]}, 90))
    show("Q3 w0 new session NO filters after w2 SIGKILL (slots 2 dead,3 absent)", c.tasks["w0"].call(
        'F = new_session(b); R = [run([F["upd"], F["c"]])[1].tolist(), float(run(F["v"]))]', 40))
finally:
    c.close()
