"""`optimize(measure=True)` measures real trials on a local cluster; the plan trains
to the same weights as single-device Keras."""
from __future__ import annotations

import numpy as np
import pytest

import autodist
from autodist import models
from autodist.search.database import Database

pytestmark = pytest.mark.cluster


def test_measured_optimize_records_trials_and_its_plan_trains_like_keras(tmp_path):
    model = models.embedding_model(num_users=300, num_items=500, dim=8, optimizer="adam")
    spec = autodist.ResourceSpec.local(workers=2, ps=1)
    before = [w.copy() for w in model.get_weights()]
    db_path = tmp_path / "trials.jsonl"
    plan = autodist.optimize(model, spec, measure=True, trials=2, batch_size=32,
                             database=db_path)
    # Measuring never changes the user's model.
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    records = Database(db_path).records()
    assert len(records) == 2 and all(r.ok for r in records), [r.error for r in records]
    assert all(len(r.step_times_s) == 10 and min(r.step_times_s) > 0 for r in records)
    measured = plan.strategy.proto.performance.measured_step_time_s
    assert np.median(measured) == pytest.approx(min(r.median_step_time_s for r in records))
    assert [t.strategy for t in plan.trials]
    assert plan.strategy.origin in ["search"] + list(plan.builder_step_times_s)

    x, y = models.synthetic_data(model, 96, seed=1)
    reference = models.single_device_twin(model)
    plan.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
