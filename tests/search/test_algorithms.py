"""Search algorithms: reproducible, never worse than their seeds, find known optima."""
from __future__ import annotations

import numpy as np
import pytest

from autodist.ir.resource_spec import ResourceSpec
from autodist.search import builders
from autodist.search.algorithms import (coordinate_descent, evolutionary, random_search,
                                        search)
from autodist.search.simulator import Simulator
from autodist.search.space import SearchSpace, SpaceOptions
from tests.search import workloads


@pytest.fixture(name="space")
def _space():
    gi = workloads.many_variables(30)
    return SearchSpace(gi, ResourceSpec.local(workers=4, ps=2, bandwidth_gbps=1),
                       SpaceOptions(consistency=("sync", "async")))


def _separable(space, seed=0):
    """A score with a known optimum: a random cost per (entry, option), summed."""
    rng = np.random.default_rng(seed)
    costs = [rng.random(n) for n in space.option_counts]
    optimum = np.array([int(np.argmin(c)) for c in costs])

    def score(candidates):
        candidates = np.atleast_2d(candidates)
        return sum(costs[j][candidates[:, j]] for j in range(candidates.shape[1]))
    return score, optimum


def test_coordinate_descent_finds_a_separable_optimum(space):
    score, optimum = _separable(space)
    result = coordinate_descent(space, score, space.sample(1, np.random.default_rng(0))[0],
                                np.random.default_rng(0))
    assert (result.best == optimum).all()
    assert result.scores[0] == pytest.approx(score(optimum)[0])


def test_evolution_improves_on_random_sampling_at_equal_budget(space):
    score, optimum = _separable(space, seed=1)
    rs = random_search(space, score, 2000, np.random.default_rng(0))
    ev = evolutionary(space, score, np.random.default_rng(0), population=50, generations=39)
    assert ev.evaluated == rs.evaluated == 2000
    assert ev.scores[0] < rs.scores[0]
    assert ev.scores[0] >= score(optimum)[0]


@pytest.mark.parametrize("algorithm", ["random", "greedy", "evolutionary", "auto"])
def test_search_is_seeded_and_never_worse_than_its_seeds(space, algorithm):
    sim = Simulator(space)
    seeds = [space.encode(cls().build(space.graph_item, space.resource_spec))
             for cls in builders.STRATEGY_BUILDERS.values()]

    def score(c):
        return sim.predict(c).step_time_s
    a = search(space, score, algorithm=algorithm, budget=1500, seed=3, seeds=seeds)
    b = search(space, score, algorithm=algorithm, budget=1500, seed=3, seeds=seeds)
    assert (a.candidates == b.candidates).all()
    assert a.scores[0] <= score(np.stack(seeds)).min() + 1e-15
    assert list(a.scores) == sorted(a.scores)
    assert len(np.unique(a.candidates, axis=0)) == len(a.candidates)


def test_bad_arguments(space):
    with pytest.raises(ValueError, match="unknown search algorithm 'annealing'"):
        search(space, lambda c: np.zeros(len(c)), algorithm="annealing")
    with pytest.raises(ValueError, match="budget must be >= 1"):
        search(space, lambda c: np.zeros(len(c)), budget=0)
