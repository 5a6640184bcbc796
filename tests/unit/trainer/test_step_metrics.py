"""Step metrics the driver assembles: an update's over data-parallel ranks (each rank reports its own
shard; their mean is logged, before rank 0's alone), scoring over DAPO rounds, throughput per device."""

from __future__ import annotations

import pytest

from megarl.trainer.loop import mean_over_ranks

pytestmark = pytest.mark.unit


def test_each_metric_is_the_mean_of_the_ranks_reporting_it() -> None:
    ranks = [{"actor/pg_clipfrac": 0.25, "actor/grad_norm": 2.0, "actor/entropy": 1.0},
             {"actor/pg_clipfrac": 0.75, "actor/grad_norm": 2.0, "actor/entropy": 2.0, "actor/kl_loss": 0.5}]
    assert mean_over_ranks(ranks) == {"actor/pg_clipfrac": 0.5, "actor/grad_norm": 2.0, "actor/entropy": 1.5,
                                      "actor/kl_loss": 0.5}
    assert mean_over_ranks([{"critic/vf_loss": 3.0}]) == {"critic/vf_loss": 3.0}


def test_scoring_metrics_of_dapo_rounds_add_up_over_the_step() -> None:
    """Two generation rounds of 8 and 24 rows: counts and seconds add, means weigh by rows (before,
    the last round's values replaced the first's)."""
    from megarl.trainer.loop import merge_round_metrics

    first = {"reward/num_failed": 1.0, "reward/time_s": 0.5, "reward/overlong_ratio": 0.5,
             "reward/worker_restarts": 0.0, "reward_model/score/max": 2.0, "reward_model/score/min": -1.0}
    second = {"reward/num_failed": 2.0, "reward/time_s": 0.25, "reward/overlong_ratio": 0.25,
              "reward/worker_restarts": 1.0, "reward_model/score/max": 1.0, "reward_model/score/min": -3.0}
    assert merge_round_metrics({}, 0, first, 8) == first
    assert merge_round_metrics(first, 8, second, 24) == {
        "reward/num_failed": 3.0, "reward/time_s": 0.75, "reward/overlong_ratio": (0.5 * 8 + 0.25 * 24) / 32,
        "reward/worker_restarts": 1.0, "reward_model/score/max": 2.0, "reward_model/score/min": -3.0}


def test_throughput_counts_the_devices_of_every_pool() -> None:
    """`perf/throughput` is tokens per second per device of the run: a critic, reference or rollout
    pool's devices count too (before, the actor pool's alone)."""
    from megarl.config.schema import PoolConfig, ResourcesConfig
    from megarl.trainer.loop import run_devices

    assert run_devices(ResourcesConfig(actor_pool=PoolConfig(2, 4))) == 8
    assert run_devices(ResourcesConfig(actor_pool=PoolConfig(1, 4), critic_pool=PoolConfig(1, 2),
                                       rollout_pool=PoolConfig(2, 1))) == 8


def test_the_last_step_of_a_data_bounded_dapo_run_is_estimated_from_the_batches_a_step_takes() -> None:
    """100 batches; 10 steps took 30 (3 a step): 70 left, about 24 more steps. The total shown had
    been epochs x batches (100), about three times too many."""
    from megarl.trainer.loop import estimated_last_step

    assert estimated_last_step(10, 30, 100) == 10 + 24
    assert estimated_last_step(10, 10, 100) == 100  # one batch a step: the plain count
    assert estimated_last_step(5, 100, 100) == 5  # the data is used up


def test_rollout_busy_time_of_a_dapo_step_adds_up_its_generation_rounds() -> None:
    """DAPO's dynamic sampling generates until enough groups carry a signal: here 3 rounds, whose
    slowest rollout ranks were busy 1, 2 and 4 s. The step's `async/rollout_busy_s` is their sum
    (before, the last round's 4 s alone), and `train/num_gen_batches` (verl's DAPO name) counts them."""
    import contextlib
    from types import SimpleNamespace

    import numpy as np
    import torch

    from megarl.protocol import Batch
    from megarl.trainer.loop import RLTrainer
    from megarl.workers.roles import ROLLOUT_BUSY

    busy = {0: [0.5, 1.0, 0.25, 1.0], 1: [2.0, 1.5, 2.0, 0.1], 2: [4.0, 3.0, 4.0, 3.5]}  # per row, by round
    # Response scores by round: round 0's two groups score alike (filtered), round 1 keeps group a,
    # round 2 both: 3 prompts kept, 2 needed.
    scores = {0: [1.0, 1.0, 0.0, 0.0], 1: [1.0, 0.0, 0.0, 0.0], 2: [0.0, 1.0, 1.0, 0.0]}
    cfg = SimpleNamespace(algorithm=SimpleNamespace(filter_groups=SimpleNamespace(
        enable=True, metric="seq_reward", max_num_gen_batches=10)), data=SimpleNamespace(train_batch_size=2))

    def rollout_batch(step: int, attempt: int) -> Batch:
        gen = Batch.from_dict({"responses": torch.ones(4, 3, dtype=torch.int64),
                               ROLLOUT_BUSY: torch.tensor(busy[attempt], dtype=torch.float64)},
                              {"uid": np.array([f"{attempt}-a", f"{attempt}-a", f"{attempt}-b", f"{attempt}-b"],
                                               dtype=object)})
        return RLTrainer.take_busy_time(trainer, gen)

    def score(gen: Batch) -> tuple[Batch, dict]:
        attempt = int(gen["uid"][0].split("-")[0])
        gen["token_level_scores"] = torch.zeros(4, 3)
        gen["token_level_scores"][:, -1] = torch.tensor(scores[attempt])
        return gen, {"reward/time_s": 0.5}

    trainer = SimpleNamespace(cfg=cfg, rollout_busy_s=0.0, rollout_batch=rollout_batch, score=score,
                              phase=lambda name: contextlib.nullcontext())
    batch, metrics = RLTrainer.collect_scored_batch(trainer, step=1)
    assert metrics["train/num_gen_batches"] == 3 and metrics["dapo/num_prompts_kept"] == 3
    assert sorted(set(batch["uid"].tolist())) == ["1-a", "2-a"]
    assert metrics["reward/time_s"] == 1.5  # scoring adds up over the rounds too
    assert trainer.rollout_busy_s == 1.0 + 2.0 + 4.0
