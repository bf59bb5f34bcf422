"""Search algorithms over a SearchSpace: random sampling, coordinate descent, evolution.

Each algorithm takes a vectorised `score` (an (N, V + 1) candidate matrix →
N scores, lower is better: a predicted step time or a ranker's score) and a
seeded `numpy.random.Generator`, so a search is reproducible. Algorithms
score whole batches at once; none loops over candidates in Python.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from autodist.search.space import SearchSpace

Score = Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass
class SearchResult:
    """Distinct candidates found, best first.

    Attributes:
        candidates: (K, V + 1) candidate matrix sorted by score.
        scores: Their scores (ascending).
        evaluated: How many candidates were scored in all (with repeats).
    """

    candidates: np.ndarray
    scores: np.ndarray
    evaluated: int

    @property
    def best(self) -> np.ndarray:
        return self.candidates[0]

    def merge(self, other: SearchResult, keep: int) -> SearchResult:
        """The best `keep` distinct candidates of both results."""
        return _top(np.concatenate([self.candidates, other.candidates]),
                    np.concatenate([self.scores, other.scores]), keep,
                    self.evaluated + other.evaluated)


def _top(candidates: np.ndarray, scores: np.ndarray, keep: int, evaluated: int) -> SearchResult:
    candidates, scores = _best_rows(candidates, scores, keep)
    unique, index = _unique_rows(candidates)
    unique_scores = scores[index]
    order = np.lexsort((np.arange(len(unique)), unique_scores))[:keep]
    return SearchResult(unique[order], unique_scores[order], evaluated)


def _unique_rows(candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(candidates, axis=0, return_index=True)`, fast for wide rows."""
    if not len(candidates):
        return candidates, np.zeros(0, dtype=np.int64)
    order = np.lexsort(candidates.T[::-1])  # stable: equal rows keep their order
    ordered = candidates[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    return ordered[first], order[first]


def _best_rows(candidates: np.ndarray, scores: np.ndarray,
               keep: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows that can be among the best `keep` distinct ones: by score, up to the
    `keep`-th distinct row, with every row tied with it.

    Sorting every row (as `np.unique` does) costs far more than scoring when
    a search saw tens of thousands of wide candidates; repeats of a
    candidate have its score, so the rows cut off cannot matter.
    """
    if len(candidates) <= 4 * keep:
        return candidates, scores
    order = np.argsort(scores, kind="stable")
    seen: set[bytes] = set()
    end = len(order)
    for i, row in enumerate(order):
        if len(seen) >= keep and scores[row] > scores[order[i - 1]]:
            end = i
            break
        seen.add(candidates[row].tobytes())
    chosen = order[:end]
    return candidates[chosen], scores[chosen]


def random_search(space: SearchSpace, score: Score, num_samples: int,
                  rng: np.random.Generator, prior: str = "uniform",
                  keep: int = 32) -> SearchResult:
    """Scores `num_samples` candidates sampled from the space's prior."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1. Received: {num_samples!r}")
    candidates = space.sample(num_samples, rng, prior)
    return _top(candidates, np.asarray(score(candidates)), keep, num_samples)


def coordinate_descent(space: SearchSpace, score: Score, start: np.ndarray,
                       rng: np.random.Generator, max_rounds: int = 3,
                       keep: int = 32) -> SearchResult:
    """Greedy per-variable refinement from `start`.

    Visits the entries (variables, then the consistency) in a random order;
    for each, scores every option with the rest fixed and keeps the best.
    Stops after a round without improvement or after `max_rounds`.
    """
    current = np.array(start, dtype=np.int64)
    counts = space.option_counts
    current_score = float(np.asarray(score(current[None, :]))[0])
    # The best so far, merged after each entry (the trials of a wide model
    # would not fit in memory all at once).
    result = _top(current[None, :], np.array([current_score]), keep, 1)
    for _ in range(max_rounds):
        improved = False
        for j in rng.permutation(len(counts)):
            trial = np.repeat(current[None, :], counts[j], axis=0)
            trial[:, j] = np.arange(counts[j])
            scores = np.asarray(score(trial))
            result = result.merge(_top(trial, scores, keep, len(trial)), keep)
            best = int(np.argmin(scores))
            if scores[best] < current_score - 1e-15:
                current, current_score, improved = trial[best].copy(), float(scores[best]), True
        if not improved:
            break
    return result


def evolutionary(space: SearchSpace, score: Score, rng: np.random.Generator, *,
                 population: int = 64, generations: int = 20, mutation_rate: float | None = None,
                 seeds: Sequence[np.ndarray] = (), prior: str = "knowledge",
                 keep: int = 32) -> SearchResult:
    """A steady evolutionary search: tournaments, uniform crossover, mutation, elitism.

    Args:
        population: Candidates per generation.
        generations: Number of generations.
        mutation_rate: Probability that an entry is resampled (default 1 / entries).
        seeds: Candidates placed in the first population (e.g. builders').
        prior: Prior of the initial samples and of mutations.
    """
    if population < 2:
        raise ValueError(f"population must be >= 2. Received: {population!r}")
    counts = space.option_counts
    rate = mutation_rate if mutation_rate is not None else 1.0 / len(counts)
    pop = space.sample(population, rng, prior)
    if len(seeds):
        seeds_matrix = np.asarray(seeds, dtype=np.int64)[:population]
        pop[:len(seeds_matrix)] = seeds_matrix
    fitness = np.asarray(score(pop))
    seen_c, seen_s, evaluated = [pop], [fitness], population
    elite = max(1, population // 8)
    for _ in range(generations):
        a, b = rng.integers(0, population, (2, population))
        parents1 = np.where((fitness[a] <= fitness[b])[:, None], pop[a], pop[b])
        a, b = rng.integers(0, population, (2, population))
        parents2 = np.where((fitness[a] <= fitness[b])[:, None], pop[a], pop[b])
        children = np.where(rng.random(pop.shape) < 0.5, parents1, parents2)
        mutate = rng.random(pop.shape) < rate
        children = np.where(mutate, space.sample(population, rng, prior), children)
        child_fitness = np.asarray(score(children))
        evaluated += population
        seen_c.append(children)
        seen_s.append(child_fitness)
        order = np.argsort(fitness, kind="stable")[:elite]
        pop = np.concatenate([pop[order], children[:population - elite]])
        fitness = np.concatenate([fitness[order], child_fitness[:population - elite]])
    return _top(np.concatenate(seen_c), np.concatenate(seen_s), keep, evaluated)


ALGORITHMS = ("random", "greedy", "evolutionary", "auto")


def search(space: SearchSpace, score: Score, *, algorithm: str = "auto", budget: int = 4000,
           seed: int = 0, seeds: Sequence[np.ndarray] = (), keep: int = 32) -> SearchResult:
    """Runs one algorithm (or "auto": all three) within about `budget` scored candidates.

    "auto" spends a quarter of the budget on knowledge-prior sampling, half on
    evolution seeded with `seeds` and the samples' best, and refines the best
    candidate so far by coordinate descent. `seeds` are always scored, so the
    result is never worse than the best seed.

    Returns:
        The best `keep` distinct candidates.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown search algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1. Received: {budget!r}")
    rng = np.random.default_rng(seed)
    seed_matrix = (np.asarray(seeds, dtype=np.int64) if len(seeds)
                   else np.empty((0, space.num_variables + 1), dtype=np.int64))
    result = _top(seed_matrix, np.asarray(score(seed_matrix)) if len(seed_matrix)
                  else np.empty(0), keep, len(seed_matrix))
    start = result.best if len(result.candidates) else space.sample(1, rng, "knowledge")[0]
    if algorithm == "random":
        return result.merge(random_search(space, score, budget, rng, "knowledge", keep), keep)
    if algorithm == "greedy":
        return result.merge(coordinate_descent(space, score, start, rng, keep=keep), keep)
    population = max(8, min(128, budget // 40))
    if algorithm == "evolutionary":
        generations = max(1, budget // population - 1)
        return result.merge(evolutionary(space, score, rng, population=population,
                                         generations=generations, seeds=seed_matrix,
                                         keep=keep), keep)
    result = result.merge(random_search(space, score, max(1, budget // 4), rng, "knowledge",
                                        keep), keep)
    generations = max(1, (budget // 2) // population - 1)
    seeds_and_best = np.concatenate([seed_matrix, result.candidates[:population // 4]])
    result = result.merge(evolutionary(space, score, rng, population=population,
                                       generations=generations, seeds=seeds_and_best,
                                       keep=keep), keep)
    return result.merge(coordinate_descent(space, score, result.best, rng, keep=keep), keep)
