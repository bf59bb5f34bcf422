"""Benchmarks shipped with autodist (`autodist bench`): strategies vs baselines.

`autodist.bench.emulated` measures, on an emulated local cluster with capped
links (`autodist.bench.capped_links`), every builder and `optimize`'s pick side by
side with single-device Keras and a `MultiWorkerMirroredStrategy` custom
loop (`autodist.bench.mwms`), and writes CSV, markdown and a PNG plot.
`autodist.bench.trials` and `.shipping` hold the library parts of the trial
data set's collector and cost-model trainer (`benchmarks/collect_trials.py`,
`benchmarks/train_cost_model.py`), `.slowdown` a deliberately slowed task.
This package sits at the api layer (it uses `autodist.optimize`); importing
it does no work.
"""
