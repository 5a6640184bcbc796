"""`resources.cpu_grad_reduce`: at DP=2 with plain DDP the actor's gradients are summed through
shared memory or with gloo's all-reduce. With two ranks both add the same two numbers, so the runs
are bit-identical (same seed), and `actor/grad_reduce_shared_memory` says which path ran. The time it
saves is measured by benchmarks/host_reduce.py, not here."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_train_e2e import read_metrics, run_train, task_dir, write_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean",
            "training/rollout_logprob_abs_diff_mean")


def test_gradients_summed_through_shared_memory_train_like_gloo(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    runs = {}
    for reduce in ("shared_memory", "gloo"):
        work = tmp_path / reduce
        work.mkdir()
        config = write_config(work, task_dir, trainer={"total_training_steps": 3},
                              # A fresh model scores 0 everywhere: the entropy bonus gives the gradient.
                              actor={"megatron": {"tensor_model_parallel_size": 1}, "entropy_coeff": 0.01,
                                     "optim": {"use_distributed_optimizer": False}},
                              resources={"cpu_grad_reduce": reduce})
        assert run_train(config).returncode == 0
        runs[reduce] = read_metrics(work / "run")
    for step in (1, 2, 3):
        shared, gloo = runs["shared_memory"][step], runs["gloo"][step]
        assert shared["actor/grad_reduce_shared_memory"] == 1.0 and gloo["actor/grad_reduce_shared_memory"] == 0.0
        for key in COMPARED:
            assert shared[key] == gloo[key], (step, key, shared[key], gloo[key])
    assert all(runs["gloo"][step]["actor/grad_norm"] > 0 for step in (1, 2, 3))  # there was a sum to take
    assert runs["gloo"][3]["actor/entropy"] != runs["gloo"][1]["actor/entropy"]  # and the policy moved
