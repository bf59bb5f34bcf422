"""A worker task's lowered program run in this process: its graph with the task's
devices as this process's (two logical CPUs stand for the task's replicas)."""
from __future__ import annotations

import tensorflow as tf


def local_graph(program) -> tf.Graph:
    """`program.graph` imported into a new graph whose ops run on this process's devices
    (names of its ops and tensors unchanged)."""
    graph_def = program.graph.as_graph_def()
    for node in graph_def.node:
        node.device = node.device.replace("/job:worker/replica:0/task:0", "") \
            .replace("/job:worker/task:0", "")
    local = tf.Graph()
    with local.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return local
