"""After a resume the driver's state (counters, data-loader position, KL controller) must equal what
was saved: a sampler or controller that ignores part of its saved state is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.algorithms.kl import make_kl_controller
from megarl.data.sampler import StatefulSampler
from megarl.errors import CheckpointError
from megarl.trainer.checkpointing import check_driver_state_restored

pytestmark = pytest.mark.unit


def _state(sampler: StatefulSampler, kl: object, step: int) -> dict:
    return {"global_step": step, "weights_version": step, "dataloader": {"sampler": sampler.state_dict()},
            "kl_ctrl": kl.state_dict()}


def test_restored_state_passes_and_a_lost_position_is_named(tmp_path: Path) -> None:
    sampler = StatefulSampler(40, 4, shuffle=True, seed=2)
    kl = make_kl_controller("adaptive", 0.05, target_kl=0.1, horizon=100)
    for _ in range(3):
        sampler.next_batch()
    kl.update(0.3, 8)
    saved = _state(sampler, kl, 3)

    resumed_sampler = StatefulSampler(40, 4, shuffle=True, seed=2)
    resumed_kl = make_kl_controller("adaptive", 0.05, target_kl=0.1, horizon=100)
    resumed_sampler.load_state_dict(saved["dataloader"]["sampler"])
    resumed_kl.load_state_dict(saved["kl_ctrl"])
    check_driver_state_restored(saved, _state(resumed_sampler, resumed_kl, 3), tmp_path)
    assert resumed_sampler.next_batch()[1].tolist() == sampler.next_batch()[1].tolist()  # continues in step

    fresh_sampler = StatefulSampler(40, 4, shuffle=True, seed=2)  # position never restored
    with pytest.raises(CheckpointError) as err:
        check_driver_state_restored(saved, _state(fresh_sampler, resumed_kl, 3), tmp_path)
    text = str(err.value)
    assert str(tmp_path / "trainer_state.pt") in text and "dataloader: saved" in text and "'position': 3" in text
    assert "kl_ctrl" not in text and "global_step" not in text


def test_changed_kl_settings_are_not_a_lost_state(tmp_path: Path) -> None:
    """target_kl and horizon (and a fixed coefficient) are the config's after a resume: only the
    adaptive coefficient must come back."""
    sampler = StatefulSampler(40, 4, shuffle=True, seed=2)
    kl = make_kl_controller("adaptive", 0.05, target_kl=0.1, horizon=100)
    kl.update(0.3, 8)
    saved = _state(sampler, kl, 3)
    resumed_kl = make_kl_controller("adaptive", 0.05, target_kl=0.2, horizon=50)
    resumed_kl.load_state_dict(saved["kl_ctrl"])
    check_driver_state_restored(saved, _state(sampler, resumed_kl, 3), tmp_path)
    fixed = make_kl_controller("fixed", 0.01)
    fixed.load_state_dict(make_kl_controller("fixed", 0.02).state_dict())
    check_driver_state_restored(_state(sampler, make_kl_controller("fixed", 0.02), 3), _state(sampler, fixed, 3),
                                tmp_path)

    lost = make_kl_controller("adaptive", 0.05, target_kl=0.2, horizon=50)  # coefficient never restored
    with pytest.raises(CheckpointError, match="kl_ctrl: saved"):
        check_driver_state_restored(saved, _state(sampler, lost, 3), tmp_path)
