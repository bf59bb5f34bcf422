"""Strategy search: builders, the search space, simulator, cost models, database and tuner.

Example:
    >>> from autodist.search.tuner import Tuner           # doctest: +SKIP
    >>> result = Tuner(gi, spec).tune()                   # doctest: +SKIP
    >>> result.strategy, result.predicted_step_time_s     # doctest: +SKIP

Modules are imported on use so that importing the package stays cheap. One
module per part of the loop, one per role's interface:
`autodist.search.space` (the candidates), `.simulator` (the analytic
model), `.features`, `.predictor` (the cost-model role) and `.cost_model`
(its implementations: LightGBM, the simulator), `.metrics`, `.database`
(trial records), `.runner` (the measuring role: `Runner`, `MeasureResult`;
the runtime's `LocalRunner` implements it), `.algorithms`,
`.measure_callback` (what happens after a measured round) and `.tuner`.
"""
