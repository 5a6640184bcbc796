"""Advantage estimators against plain float64 loops, hand-worked examples and edge cases."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import megarl.algorithms.advantages as advantages_module
from megarl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageSettings,
    get_advantage_estimator,
    group_index_from_uids,
)
from megarl.errors import ConfigError, DataError

from . import loop_reference as ref
from .random_inputs import random_rollout

pytestmark = pytest.mark.unit

SEEDS = [0, 1, 2]


def as_lists(t: torch.Tensor) -> list:
    return t.double().tolist()


def assert_matches(actual: torch.Tensor, expected: list, atol: float = 1e-10) -> None:
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


def estimate(name: str, rewards: torch.Tensor, mask: torch.Tensor,
             settings: AdvantageSettings = AdvantageSettings(), **fields):
    """The named estimator on ``AdvantageInputs(rewards, mask, **fields)``."""
    return get_advantage_estimator(name)(AdvantageInputs(rewards, mask, **fields), settings)


def run(name: str, data, settings: AdvantageSettings = AdvantageSettings(), **fields):
    return estimate(name, data.rewards, data.mask, settings, **fields)


# ----------------------------------------------------------------------------------------------
# Against the loop references, random inputs (variable lengths, observation holes, an empty row)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_reference(seed: int, gamma: float, lam: float) -> None:
    d = random_rollout(seed)
    adv, ret = run("gae", d, AdvantageSettings(gamma=gamma, lam=lam), values=d.values)
    exp_adv, exp_ret = ref.gae(as_lists(d.rewards), as_lists(d.values), as_lists(d.mask), gamma, lam)
    assert_matches(adv, exp_adv)
    assert_matches(ret, exp_ret)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_reference(seed: int, gamma: float) -> None:
    d = random_rollout(seed)
    adv, ret = run("reinforce_plus_plus", d, AdvantageSettings(gamma=gamma))
    exp_adv, exp_ret = ref.reinforce_pp(as_lists(d.rewards), as_lists(d.mask), gamma)
    assert_matches(adv, exp_adv)
    assert_matches(ret, exp_ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_remax_matches_reference(seed: int) -> None:
    d = random_rollout(seed)
    adv, ret = run("remax", d, baseline_rewards=d.baselines)
    exp_adv, exp_ret = ref.remax(as_lists(d.rewards), as_lists(d.mask), d.baselines.tolist())
    assert_matches(adv, exp_adv)
    assert_matches(ret, exp_ret)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_reference(seed: int, norm: bool) -> None:
    d = random_rollout(seed, outcome_only=seed == 0)
    adv, ret = run("grpo", d, AdvantageSettings(norm_adv_by_std=norm), group_index=d.group_index)
    expected = ref.grpo(as_lists(d.rewards), as_lists(d.mask), d.group_index.tolist(), norm)
    assert_matches(adv, expected)
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_reference(seed: int) -> None:
    d = random_rollout(seed)
    adv, _ = run("rloo", d, group_index=d.group_index)
    assert_matches(adv, ref.rloo(as_lists(d.rewards), as_lists(d.mask), d.group_index.tolist()))


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline_matches_reference(seed: int) -> None:
    d = random_rollout(seed)
    adv, _ = run("reinforce_plus_plus_baseline", d, group_index=d.group_index)
    expected = ref.reinforce_pp_baseline(as_lists(d.rewards), as_lists(d.mask), d.group_index.tolist())
    assert_matches(adv, expected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [None, 2, 3])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_matches_brute_force(seed: int, k: int | None, norm: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    group_index = torch.tensor([5, 5, 5, 9, 9, 9, 9, 2, 2, 2, 2, 2])[torch.randperm(12, generator=gen)]
    rewards = torch.randint(0, 3, (12, 4), generator=gen).double()  # small integers: ties happen
    mask = torch.ones(12, 4)
    adv, _ = estimate("grpo_passk", rewards, mask, AdvantageSettings(pass_k=k, norm_adv_by_std=norm),
                      group_index=group_index)
    expected = ref.grpo_passk(as_lists(rewards), as_lists(mask), group_index.tolist(), k, norm)
    assert_matches(adv, expected)


def test_float32_inputs_keep_dtype_and_match() -> None:
    d = random_rollout(4, dtype=torch.float32)
    for name, kw in [
        ("gae", {"values": d.values}),
        ("grpo", {"group_index": d.group_index}),
        ("rloo", {"group_index": d.group_index}),
    ]:
        adv, ret = run(name, d, **kw)
        assert adv.dtype == ret.dtype == torch.float32
    adv, _ = run("gae", d, AdvantageSettings(gamma=0.99, lam=0.95), values=d.values)
    expected, _ = ref.gae(as_lists(d.rewards), as_lists(d.values), as_lists(d.mask), 0.99, 0.95)
    assert_matches(adv, expected, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Hand-worked examples


def test_grpo_hand_example() -> None:
    # Group {1, 0, 1, 0}: mean 0.5, unbiased std sqrt(1/3); group {2, 2}: zero variance.
    rewards = torch.zeros(6, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0])
    mask = torch.ones(6, 3)
    mask[1, 2] = 0  # a shorter response: its advantage is 0 on the padded token only
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    adv, _ = estimate("grpo", rewards, mask, group_index=group)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    # row 1 sums its rewards over all tokens (verl): its masked last token held 0 anyway
    torch.testing.assert_close(adv[:, 0], torch.tensor([a, -a, a, -a, 0.0, 0.0]))
    assert adv[1, 2] == 0.0
    dr_adv, _ = estimate("grpo", rewards, mask, AdvantageSettings(norm_adv_by_std=False), group_index=group)
    torch.testing.assert_close(dr_adv[:, 0], torch.tensor([0.5, -0.5, 0.5, -0.5, 0.0, 0.0]))


def test_rloo_hand_example() -> None:
    rewards = torch.tensor([[1.0], [0.0], [0.0], [5.0]])
    adv, _ = estimate("rloo", rewards, torch.ones(4, 1), group_index=torch.tensor([0, 0, 0, 1]))
    # 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5; singleton: baseline 0
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -0.5, -0.5, 5.0]))


def test_gae_hand_example_with_observation_tokens() -> None:
    # Tokens: a, [obs], b; gamma = lam = 1. The observation is skipped: a bootstraps from b's value.
    rewards = torch.tensor([[0.0, 7.0, 1.0]])  # the reward on the observation is ignored
    values = torch.tensor([[0.5, 9.0, 0.25]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    _, ret = estimate("gae", rewards, mask, values=values)
    # delta_b = 1 - 0.25 = 0.75 -> A_b = 0.75; delta_a = 0 + 0.25 - 0.5 = -0.25 -> A_a = 0.5
    torch.testing.assert_close(ret, torch.tensor([[0.5 + 0.5, 0.0, 0.75 + 0.25]]))


def test_reinforce_plus_plus_credits_earlier_turns() -> None:
    # Tokens: a1, a2, [obs], [obs], b1, b2; the outcome reward on b2. The observation passes the return
    # through: a1 gets gamma^3, as if the observation were not there; the losing episode gets 0.
    gamma = 0.5
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1], [1.0, 1, 0, 0, 1, 1]])
    rewards = torch.tensor([[0.0, 0, 0, 0, 0, 1], [0.0, 0, 0, 0, 0, 0]])
    _, ret = estimate("reinforce_plus_plus", rewards, mask, AdvantageSettings(gamma=gamma))
    torch.testing.assert_close(ret, torch.tensor([[0.125, 0.25, 0, 0, 0.5, 1], [0.0, 0, 0, 0, 0, 0]]))


def test_passk_full_group_is_best_minus_second() -> None:
    rewards = torch.tensor([[0.2], [0.9], [0.5], [0.9]])
    dr = AdvantageSettings(norm_adv_by_std=False)
    adv, _ = estimate("grpo_passk", rewards, torch.ones(4, 1), dr, group_index=torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, 0.0, 0.0, 0.0]))  # tie at the top: 0.9 - 0.9
    rewards[3, 0] = 0.1
    adv, _ = estimate("grpo_passk", rewards, torch.ones(4, 1), dr, group_index=torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, 0.4, 0.0, 0.0]))


# ----------------------------------------------------------------------------------------------
# Edge cases


GROUP_FREE = {"gae", "reinforce_plus_plus", "remax"}


def full_kwargs(d) -> dict:
    return dict(group_index=d.group_index, values=d.values, baseline_rewards=d.baselines)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_empty_batch(name: str) -> None:
    empty = torch.zeros(0, 5)
    adv, ret = estimate(
        name, empty, empty, group_index=torch.zeros(0, dtype=torch.long), values=empty, baseline_rewards=torch.zeros(0)
    )
    assert adv.shape == ret.shape == (0, 5)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_outputs_zero_outside_mask_and_finite(name: str) -> None:
    d = random_rollout(7, batch=20)
    d.group_index = torch.arange(20) // 4  # groups of 4 (pass@k needs >= 2)
    adv, ret = run(name, d, **full_kwargs(d))
    for out in (adv, ret):
        assert torch.isfinite(out).all()
        assert (out[d.mask == 0] == 0).all()


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_all_masked_row_does_not_change_the_others(name: str) -> None:
    # Whitening statistics come from valid tokens only: appending a fully masked row changes nothing.
    d = random_rollout(3, batch=8, holes=False)
    d.group_index = torch.arange(8)
    adv, _ = run(name, d, **full_kwargs(d))
    rewards = torch.cat([d.rewards, torch.randn(1, d.rewards.shape[1], dtype=torch.float64)])
    mask = torch.cat([d.mask, torch.zeros(1, d.mask.shape[1], dtype=d.mask.dtype)])
    kwargs = dict(group_index=torch.arange(9), values=torch.cat([d.values, d.values[:1]]))
    adv_plus, _ = estimate(name, rewards, mask, **kwargs)
    torch.testing.assert_close(adv_plus[:8], adv)
    assert (adv_plus[8] == 0).all()


@pytest.mark.parametrize("name", ["grpo", "rloo", "grpo_passk"])
def test_zero_variance_group_gets_zero_advantage(name: str) -> None:
    rewards = torch.tensor([[1.0], [1.0], [1.0], [0.0], [1.0]])
    group = torch.tensor([0, 0, 0, 1, 1])
    adv, _ = estimate(name, rewards, torch.ones(5, 1), group_index=group)
    assert (adv[:3] == 0).all()
    assert (adv[3:] != 0).any()


def test_singleton_groups() -> None:
    rewards = torch.tensor([[3.0], [1.0], [2.0]])
    group = torch.tensor([0, 1, 1])
    grpo, _ = estimate("grpo", rewards, torch.ones(3, 1), group_index=group)
    assert grpo[0, 0].item() == pytest.approx(3.0 / (1.0 + 1e-6))  # mean 0, std 1
    rloo, _ = estimate("rloo", rewards, torch.ones(3, 1), group_index=group)
    assert rloo[0, 0].item() == 3.0  # no other response: baseline 0
    with pytest.raises(DataError, match=r"at least 2 responses.*sample 0"):
        estimate("grpo_passk", rewards, torch.ones(3, 1), group_index=group)


def test_passk_k_out_of_range() -> None:
    with pytest.raises(DataError, match=r"k = 4 must be in \[2, smallest group size = 3\]"):
        estimate("grpo_passk", torch.ones(6, 1), torch.ones(6, 1), AdvantageSettings(pass_k=4),
                 group_index=torch.arange(6) // 3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_non_finite_reward_names_sample_and_uid(name: str, bad: float) -> None:
    d = random_rollout(5, batch=8)
    d.group_index = torch.arange(8) // 2
    d.rewards[6, 2] = bad
    uids = np.array([f"prompt-{i // 2}" for i in range(8)], dtype=object)
    with pytest.raises(DataError, match=r"token_level_rewards.*sample 6 \(uid 'prompt-3'\).*position 2.*"
                                        r"check the reward function"):
        run(name, d, uids=uids, **full_kwargs(d))


def test_non_finite_value_points_at_the_critic_not_the_reward_function() -> None:
    d = random_rollout(0, batch=4)
    values = d.values.clone()
    values[2, 1] = float("nan")
    with pytest.raises(DataError, match=r"values.*sample 2: nan at position 1.*critic") as caught:
        estimate("gae", d.rewards, d.mask, values=values)
    assert "reward function" not in str(caught.value)


def test_non_finite_greedy_reward_is_named_as_remax_baseline() -> None:
    d = random_rollout(0, batch=4)
    baseline = torch.zeros(4)
    baseline[3] = float("inf")
    with pytest.raises(DataError, match=r"baseline_rewards.*sample 3.*greedy responses.*reward function"):
        estimate("remax", d.rewards, d.mask, baseline_rewards=baseline)


def test_missing_inputs_are_named() -> None:
    d = random_rollout(0, batch=4)
    with pytest.raises(DataError, match="values"):
        run("gae", d)
    with pytest.raises(DataError, match="baseline_rewards"):
        run("remax", d)
    with pytest.raises(DataError, match="group_index"):
        run("grpo", d)
    with pytest.raises(DataError, match="response_mask"):
        estimate("grpo", d.rewards, d.mask[:, :-1], group_index=d.group_index[:4])


# The optional inputs each built-in estimator reads; all others it must not need.
NEEDS = {
    "gae": {"values"},
    "remax": {"baseline_rewards"},
    "grpo": {"group_index"},
    "rloo": {"group_index"},
    "reinforce_plus_plus_baseline": {"group_index"},
    "grpo_passk": {"group_index"},
    "reinforce_plus_plus": set(),
}
HOW_TO_PROVIDE = {
    "values": r"enable the critic",
    "baseline_rewards": r"rewards of the greedy responses",
    "group_index": r"group_index_from_uids",
}


def test_needs_cover_every_builtin_estimator() -> None:
    assert set(NEEDS) == set(ADVANTAGE_ESTIMATORS)


@pytest.mark.parametrize("name,field", [(n, f) for n in sorted(NEEDS) for f in sorted(NEEDS[n])])
def test_missing_needed_input_names_estimator_field_and_fix(name: str, field: str) -> None:
    d = random_rollout(1, batch=8)
    d.group_index = torch.arange(8) // 2
    fields = full_kwargs(d) | {field: None}
    with pytest.raises(DataError, match=rf"^advantage estimator '{name}' needs {field}: .*{HOW_TO_PROVIDE[field]}"):
        run(name, d, **fields)


@pytest.mark.parametrize("name", sorted(NEEDS))
def test_estimator_runs_on_exactly_what_it_needs(name: str) -> None:
    # Unneeded inputs left None change nothing: the result equals the one with every input given.
    d = random_rollout(6, batch=12)
    d.group_index = torch.arange(12) // 3
    full = full_kwargs(d)
    adv_all, ret_all = run(name, d, **full)
    adv, ret = run(name, d, **{k: v for k, v in full.items() if k in NEEDS[name]})
    assert torch.equal(adv, adv_all) and torch.equal(ret, ret_all)


def test_wrong_shaped_optional_inputs_are_named() -> None:
    d = random_rollout(0, batch=4)
    with pytest.raises(DataError, match=r"gae: values must be a \(batch, response_len\) tensor.*got \(4, 8\)"):
        run("gae", d, values=d.values[:, :-1])
    with pytest.raises(DataError, match=r"remax: baseline_rewards must be the \(batch,\) rewards.*got \(3,\)"):
        run("remax", d, baseline_rewards=d.baselines[:3])
    with pytest.raises(DataError, match=r"group_index: expected an integer tensor of shape \(4,\)"):
        run("grpo", d, group_index=d.group_index.double())


def test_inputs_and_settings_are_frozen() -> None:
    d = random_rollout(0, batch=4)
    inputs, settings = AdvantageInputs(d.rewards, d.mask), AdvantageSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.values = d.values  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.gamma = 0.5  # type: ignore[misc]


def test_unknown_estimator_lists_registered_names() -> None:
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator = 'ppo2'.*'gae'.*'grpo'"):
        get_advantage_estimator("ppo2")


def test_group_index_from_uids() -> None:
    ids = group_index_from_uids(np.array(["b", "a", "b", "c", "a"], dtype=object))
    assert ids.dtype == torch.long
    assert ids[0] == ids[2] and ids[1] == ids[4] and len(set(ids.tolist())) == 3


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus"])
def test_time_recursion_over_several_row_blocks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(advantages_module, "SCAN_BLOCK_ROWS", 5)  # 23 rows: blocks of 5, 5, 5, 5, 3
    d = random_rollout(2)
    adv, ret = run(name, d, AdvantageSettings(gamma=0.9, lam=0.8), values=d.values)
    if name == "gae":
        exp_adv, exp_ret = ref.gae(as_lists(d.rewards), as_lists(d.values), as_lists(d.mask), 0.9, 0.8)
    else:
        exp_adv, exp_ret = ref.reinforce_pp(as_lists(d.rewards), as_lists(d.mask), 0.9)
    assert_matches(adv, exp_adv)
    assert_matches(ret, exp_ret)
