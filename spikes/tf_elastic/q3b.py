"""Q3 follow-up: which step makes a size-2 collective after a size-3 one time out?"""
import signal
import sys

from builders import DEF
from common import Cluster, show

F2 = '["/job:ps", "/job:worker/task:0", "/job:worker/task:1"]'
F3 = '["/job:ps", "/job:worker/task:0", "/job:worker/task:1", "/job:worker/task:2"]'
order = sys.argv[1] if len(sys.argv) > 1 else "ACB"
c = Cluster("q3b", workers=4, ps=1)
try:
    c.start(["ps0", "w0", "w1", "w2"])
    c.call_all({n: DEF for n in ["w0", "w1", "w2"]})

    def coll_on(names, gs, gk, filters, label, inst=1, tag=None):
        code = f"F = new_session(lambda: coll({gs}, {gk}, {inst}, tag={tag}), filters={filters}); R = [run(F).tolist() for _ in range(2)]"
        r = c.call_all({n: code for n in names}, 60)
        show(label, r)
        return all(x.get("ok") for x in r.values())

    ok = coll_on(["w0", "w1", "w2"], 3, 2, F3, "gs3 key2 on w0,w1,w2")
    c.call_all({"w2": "SESS.close(); SESS = None"})
    key = 10
    for step in order:
        if not ok:
            break
        key += 1
        if step == "A":
            ok = coll_on(["w0", "w1"], 2, key, F2, f"A: gs2 key{key} on w0,w1 (w2 alive, idle)")
        elif step == "C":
            ok = coll_on(["w0"], 1, key, '["/job:ps", "/job:worker/task:0"]', f"C1: gs1 key{key} on w0")
            key += 1
            ok = ok and coll_on(["w0", "w1"], 2, key, F2, f"C2: gs2 key{key} on w0,w1")
        elif step == "D":
            ok = coll_on(["w0"], 1, key, '["/job:ps", "/job:worker/task:0"]', f"D1: gs1 key{key} inst{key} on w0", inst=key)
            key += 1
            ok = ok and coll_on(["w0", "w1"], 2, key, F2, f"D2: gs2 key{key} inst{key} on w0,w1", inst=key)
        elif step == "W":
            ok = coll_on(["w0"], 1, key, '["/job:ps", "/job:worker/task:0"]', f"W1: gs1 key{key} tag{key} on w0", tag=key)
            key += 1
            ok = ok and coll_on(["w0", "w1"], 2, key, F2, f"W2: gs2 key{key} tag{key} on w0,w1", tag=key)
        elif step == "G":
            ok = coll_on(["w0"], 1, key, '["/job:ps", "/job:worker/task:0"]', f"G1: gs1 key{key} on w0")
            key += 1
            ok = ok and coll_on(["w1"], 1, key, '["/job:ps", "/job:worker/task:1"]', f"G2: gs1 key{key} on w1")
            key += 1
            ok = ok and coll_on(["w0", "w1"], 2, key, F2, f"G3: gs2 key{key} on w0,w1 (both ran 2 extra steps)")
        elif step == "R":
            ok = coll_on(["w0", "w1"], 2, 2, F2, "R1: REUSE group key 2 (was size 3) with size 2 on w0,w1", inst=50)
            ok = True
            key += 1
            coll_on(["w0", "w1"], 2, key, F2, f"R2: then gs2 new key{key} tag{key} on w0,w1", tag=key)
            coll_on(["w0", "w1"], 1, key + 1, '["/job:ps", f"/job:worker/task:{task}"]', "R3: then gs1 new key (own) on w0 / w1 each", tag=key + 1)
            ok = False
        elif step == "K":
            c.tasks["w2"].kill(signal.SIGKILL)
            print("== K: SIGKILL w2 (idle)")
        elif step == "B":
            ok = coll_on(["w0", "w1"], 2, key, F2, f"B: gs2 key{key} on w0,w1 (after w2 killed)")
finally:
    c.close()
