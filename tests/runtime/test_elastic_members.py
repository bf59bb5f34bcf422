"""Elastic membership by worker task: a run drops a worker that is not the last.

On 3 workers + 1 PS (the small MLP, global batch 32 on 4 virtual nodes), a
run whose members go {0, 1, 2} -> {0, 2} -> {0, 1, 2} mid-run keeps its
processes, and its weights equal single-device Keras `fit` with batch 32
within 2e-5: the virtual nodes of the dropped worker move to the others and
every virtual node still reads the same examples.
"""
from __future__ import annotations

import numpy as np
import pytest

import autodist
from autodist.search import builders
from tests import small_mlp

TOLERANCE = 2e-5
EXAMPLES, BATCH, EPOCHS, NODES = 96, 32, 3, 4


@pytest.mark.cluster
def test_a_run_drops_a_worker_in_the_middle_and_takes_it_back(tmp_path):
    x, y = small_mlp.data(EXAMPLES)
    expected = small_mlp.keras_weights(small_mlp.mlp(), x, y, BATCH, EPOCHS)
    model = small_mlp.mlp()
    spec = autodist.ResourceSpec.local(workers=3, ps=1)
    strategy = builders.PS().build(autodist.capture(model), spec).with_virtual_nodes(BATCH, NODES)
    run = autodist.distribute(model, strategy, spec, job_dir=str(tmp_path / "job"),
                              step_timeout_s=60)
    history = run.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0,
                      resize_at={2: [0, 2], 6: 3})
    assert [(r["step"], tuple(r["members"])) for r in history.resizes] == \
        [(2, (0, 2)), (6, (0, 1, 2))]
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
