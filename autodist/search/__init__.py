"""Strategy search: builders, the search space, simulator, cost model, database and tuner.

Example:
    >>> from autodist.search.tuner import Tuner           # doctest: +SKIP
    >>> result = Tuner(gi, spec).tune()                   # doctest: +SKIP
    >>> result.strategy, result.predicted_step_time_s     # doctest: +SKIP

Modules are imported on use (`autodist.search.space`, `.simulator`,
`.features`, `.cost_model`, `.database`, `.algorithms`, `.tuner`) so that
importing the package stays cheap.
"""
