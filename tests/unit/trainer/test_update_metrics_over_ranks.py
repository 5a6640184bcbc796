"""An update's metrics over data-parallel ranks: each rank reports its own shard's values; the
driver logs their mean (before, rank 0's alone)."""

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
