# Executed inside task.py's namespace (tf, server, task, LEADER exist).
SESS = None
G = None


def make_config(filters=None, op_timeout_ms=20000, leader=LEADER, isolate=False,
                cluster_def=None):
    c = tf.compat.v1.ConfigProto(operation_timeout_in_ms=op_timeout_ms)
    if leader:
        c.experimental.collective_group_leader = leader
    if filters:
        c.device_filters.extend(filters)
    c.isolate_session_state = isolate
    if cluster_def is not None:
        c.cluster_def.CopyFrom(tf.train.ClusterSpec(cluster_def).as_cluster_def())
    return c


def new_session(build, **kw):
    """Closes the old session, builds a new graph with build(), opens a session."""
    global SESS, G
    if SESS is not None:
        SESS.close()
        SESS = None
    G = tf.Graph()
    with G.as_default():
        fetches = build()
    SESS = tf.compat.v1.Session(server.target, graph=G, config=make_config(**kw))
    return fetches


def run(fetch, timeout_ms=15000, feed=None):
    return SESS.run(fetch, feed_dict=feed,
                    options=tf.compat.v1.RunOptions(timeout_in_ms=timeout_ms))


ME = None  # set per task below


def me():
    return f"/job:{job}/task:{task}/device:CPU:0"


def ps_var(name="psv", init=0.0):
    with tf.device("/job:ps/task:0/device:CPU:0"):
        v = tf.compat.v1.Variable(init, use_resource=True, name=name, dtype=tf.float32)
        inited = tf.raw_ops.VarIsInitializedOp(resource=v.handle)
    return v, inited


def local_var(name="loc", init=0.0):
    with tf.device(me()):
        v = tf.compat.v1.Variable(init, use_resource=True, name=name, dtype=tf.float32)
        inited = tf.raw_ops.VarIsInitializedOp(resource=v.handle)
    return v, inited


def graph_key_tag(tag, x):
    """A group-size-1 V1 collective whose static instance_key (= tag) sets the
    session's collective graph key (and so its step-id sequence)."""
    with tf.device(me()):
        y = tf.raw_ops.CollectiveReduce(
            input=tf.zeros([1]), group_size=1, group_key=1000000 + task, instance_key=tag,
            merge_op="Add", final_op="Id", subdiv_offsets=[0], timeout_seconds=5.0)
        return x + 0.0 * y


def coll(group_size, group_key, instance_key, value=None, timeout_s=5.0, tag=None):
    with tf.device(me()):
        x = tf.constant([float(task + 1) if value is None else value])
        if tag is not None:
            x = graph_key_tag(tag, x)
        return tf.raw_ops.CollectiveReduceV2(
            input=x, group_size=tf.constant(group_size), group_key=tf.constant(group_key),
            instance_key=tf.constant(instance_key), ordering_token=[], merge_op="Add",
            final_op="Id", timeout_seconds=timeout_s)


def short(msg):
    keep, skip = [], False
    for line in str(msg).splitlines():
        s = line.strip()
        if not s:
            continue
        if s.startswith(("Detected at node", "Original stack trace")):
            skip = True
            continue
        if s.startswith("Node:") or s.startswith("From /job"):
            skip = False
        if skip or s.startswith("File ") or s.startswith("[[{{node"):
            continue
        keep.append(s)
    return " | ".join(keep)[:600]


def loop(fetch, seconds, timeout_ms=10000, feed=None):
    """Runs steps until an error or `seconds`; returns count and the error."""
    n, t_end = 0, time.time() + seconds
    try:
        while time.time() < t_end:
            run(fetch, timeout_ms=timeout_ms, feed=feed)
            n += 1
        return dict(n=n)
    except Exception as e:  # noqa: BLE001
        return dict(n=n, t_err=time.time(), type=type(e).__name__, msg=short(e))
