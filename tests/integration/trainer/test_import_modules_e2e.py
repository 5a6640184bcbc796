"""`algorithm.import_modules` through a real run: a policy loss and a KL estimator registered in the
user's file (named by a path relative to the run's directory) are found by the actor's Ray workers,
an advantage estimator by the driver."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_train_e2e import read_metrics, run_train, task_dir, write_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

PLUGIN = (Path(__file__).resolve().parents[2] / "unit" / "config" / "user_algorithms.py").read_text()


def test_user_algorithms_run_in_the_driver_and_the_workers(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    (tmp_path / "my_algorithms.py").write_text(PLUGIN)
    config = write_config(tmp_path, task_dir,
                          algorithm={"adv_estimator": "plugin_adv", "import_modules": ["my_algorithms.py"]},
                          actor={"policy_loss": {"loss_mode": "plugin_loss"}, "use_kl_loss": True,
                                 "kl_loss_type": "plugin_kl"})
    proc = run_train(config, "trainer.total_training_steps=1")
    assert proc.returncode == 0
    metrics = read_metrics(tmp_path / "run")[1]
    assert metrics["actor/plugin_loss_calls"] == 1.0  # the workers' loss is the plugin's
    assert metrics["actor/kl_loss"] >= 0.0  # (log p - log ref)^2: the plugin's KL, never negative
