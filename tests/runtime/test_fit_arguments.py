"""fit's keyword arguments: typed once (FitArguments), checked once (FitOptions)."""
import typing

import pytest

from autodist.ir.errors import AutodistError
from autodist.runtime.options import FitArguments, FitOptions


def test_fit_arguments_and_fit_options_name_the_same_options():
    fields = {f for f in FitOptions.__dataclass_fields__}
    assert set(typing.get_type_hints(FitArguments)) == fields


def test_an_unknown_keyword_names_the_closest_option():
    with pytest.raises(TypeError, match=r"'batchsize'; did you mean 'batch_size'\?") as error:
        FitOptions.from_arguments({"batchsize": 16})
    assert isinstance(error.value, AutodistError)
    with pytest.raises(TypeError, match="it takes batch_size, epochs"):
        FitOptions.from_arguments({"zzz": 1})


def test_the_run_config_is_derived_from_the_options():
    options = FitOptions.from_arguments({"epochs": 3, "initial_epoch": 1, "seed": 7,
                                         "resize_at": {0: 2, 4: [0, 2]},
                                         "checkpoint_dir": "/tmp/x"})
    config = options.run_config(global_batch_size=32, shuffle=True, step_timeout_s=5.0,
                                startup_timeout_s=9.0, task_step_delay_s={})
    assert (config.global_batch_size, config.epochs, config.first_epoch, config.seed) == \
        (32, 2, 1, 7)
    assert config.resize_at == {"0": 2, "4": [0, 2]} and config.elastic
    assert config.task_step_delay_s is None and config.job_id
    assert (config.step_timeout_s, config.startup_timeout_s) == (5.0, 9.0)
