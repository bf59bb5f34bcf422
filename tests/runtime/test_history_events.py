"""History's entries are typed; the dict reading they replaced still works, deprecated."""
import pytest

from autodist.runtime.history_events import NoiseScale, PolicyAction, Recovery, Resize


def test_entries_read_by_attribute_and_by_key_with_a_deprecation_warning():
    resize = Resize(step=3, workers=2, plan=1, seconds=0.5, members=(0, 2))
    assert (resize.step, resize.members) == (3, (0, 2))
    with pytest.warns(DeprecationWarning, match=r"Resize\.step"):
        assert resize["step"] == 3
    assert "members" in resize and sorted(resize.keys()) == sorted(resize.to_dict())
    with pytest.raises(KeyError):
        _ = resize["nope"]
    noise = NoiseScale(step=0, gradient_sq=1.0, trace_sigma=8.0, noise_scale=8.0, smoothed=8.0)
    assert "compute_s" not in noise and noise.get("compute_s") is None


def test_policy_actions_and_recoveries_from_their_dicts():
    action = PolicyAction.from_dict({"step": 4, "action": "resize", "workers": 2,
                                     "reason": "slow"})
    assert (action.step, action.action, action.details["workers"]) == (4, "resize", 2)
    assert action.to_dict() == {"step": 4, "action": "resize", "workers": 2, "reason": "slow"}
    with pytest.warns(DeprecationWarning):
        assert action["workers"] == 2
    recovery = Recovery.from_dict({"step": 5, "failed_task": 2, "cause": "task worker:2 died",
                                   "workers": 2, "estimated_loss_steps": [4]})
    assert recovery == Recovery(5, 2, "task worker:2 died", 2, (4,))
