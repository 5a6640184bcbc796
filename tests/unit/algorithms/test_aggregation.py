"""Loss aggregation: each mode against a loop, and the gradient of a mini-batch independent of how it
is cut into micro-batches and simulated data-parallel ranks."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from megarl.algorithms import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyLossInputs,
    PolicyLossSettings,
    ValueLossInputs,
    ValueLossSettings,
    agg_loss,
    compute_value_loss,
    entropy_from_logits,
    get_policy_loss,
    kl_penalty,
    mini_batch_normalisers,
)
from megarl.errors import ConfigError

from . import loop_reference as ref

pytestmark = pytest.mark.unit


def random_mask(seed: int, batch: int = 10, length: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length) < lengths.unsqueeze(1)).double()
    mask[2] = 0
    mask[5, 1] = 0  # an observation hole
    return mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_modes_match_loop(mode: str, seed: int) -> None:
    mask = random_mask(seed)
    loss = torch.randn(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    loss[mask == 0] = float("nan")  # terms outside the mask must not leak, even NaN
    expected = ref.aggregate(loss.tolist(), mask.tolist(), mode)
    assert agg_loss(loss, mask, mode).item() == pytest.approx(expected, abs=1e-12)
    # with the batch's own normalisers: the same value
    norms = mini_batch_normalisers(mask)
    assert agg_loss(loss, mask, mode, **asdict(norms)).item() == pytest.approx(expected, abs=1e-12)


def test_hand_example() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 3))
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", global_num_seqs=2, max_response_len=5).item() == (
        pytest.approx(10 / (2 * 5))
    )


def test_empty_and_bad_inputs() -> None:
    loss = torch.randn(3, 4, requires_grad=True)
    for mode in LOSS_AGG_MODES:
        out = agg_loss(loss, torch.zeros(3, 4), mode)
        out.backward()
        assert out.item() == 0.0 and (loss.grad == 0).all()
        assert agg_loss(torch.zeros(0, 4), torch.zeros(0, 4), mode).item() == 0.0
    with pytest.raises(ConfigError, match="loss_agg_mode = 'token-sum'.*token-mean"):
        agg_loss(loss, torch.ones(3, 4), "token-sum")
    with pytest.raises(ValueError, match="token-mean needs global_num_tokens"):
        agg_loss(loss, torch.ones(3, 4), "token-mean", global_num_seqs=3)
    with pytest.raises(ValueError, match="dp_size > 1 needs the global normalisers"):
        agg_loss(loss, torch.ones(3, 4), "token-mean", dp_size=2)


# ----------------------------------------------------------------------------------------------
# Gradient independence of micro-batching and data parallelism


class TinyPolicy(torch.nn.Module):
    """Hidden states -> logits; log-prob of given tokens, entropy, and a value head."""

    def __init__(self, hidden: int = 8, vocab: int = 11) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.lm_head = torch.nn.Parameter(torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.5)
        self.value_head = torch.nn.Parameter(torch.randn(hidden, generator=gen, dtype=torch.float64))

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = hidden @ self.lm_head.t()
        log_prob = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return log_prob, entropy_from_logits(logits), hidden @ self.value_head


def make_mini_batch(batch: int = 12, length: int = 9) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(42)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length) < lengths.unsqueeze(1)).double()
    mask[4] = 0  # a padding row
    mask[7, 2] = 0  # an observation token
    return {
        "hidden": torch.randn(batch, length, 8, generator=gen, dtype=torch.float64),
        "tokens": torch.randint(0, 11, (batch, length), generator=gen),
        "old_log_probs": -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3,
        "ref_log_prob": -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3,
        "advantages": torch.randn(batch, length, generator=gen, dtype=torch.float64),
        "values": torch.randn(batch, length, generator=gen, dtype=torch.float64),
        "returns": torch.randn(batch, length, generator=gen, dtype=torch.float64),
        "response_mask": mask,
    }


def actor_critic_loss(model: TinyPolicy, mb: dict, loss_name: str, mode: str, normalisers) -> torch.Tensor:
    """What the workers compute per micro-batch: policy loss - entropy bonus + KL loss + value loss."""
    log_prob, entropy, vpreds = model(mb["hidden"], mb["tokens"])
    mask = mb["response_mask"]
    norm_kwargs = asdict(normalisers) if normalisers is not None else {}
    pg_loss, _ = get_policy_loss(loss_name)(
        PolicyLossInputs(mb["old_log_probs"], log_prob, mb["advantages"], mask, normalisers=normalisers),
        PolicyLossSettings(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28),
    )
    entropy_loss = agg_loss(entropy, mask, mode, **norm_kwargs)
    kl_loss = agg_loss(kl_penalty(log_prob, mb["ref_log_prob"], "low_var_kl"), mask, mode, **norm_kwargs)
    vf_loss, _ = compute_value_loss(
        ValueLossInputs(vpreds, mb["returns"], mb["values"], mask, normalisers=normalisers),
        ValueLossSettings(cliprange_value=0.5, loss_agg_mode=mode),
    )
    return pg_loss - 0.01 * entropy_loss + 0.1 * kl_loss + 0.5 * vf_loss


def split_rows(mb: dict, pieces: int) -> list[dict]:
    """Uneven row chunks (tensor_split), as a real batch of 12 cut into 4 or 5 pieces gives."""
    chunks = {k: torch.tensor_split(v, pieces) for k, v in mb.items()}
    return [{k: chunks[k][i] for k in mb} for i in range(pieces)]


def gradient(model: TinyPolicy) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()]).clone()


def full_gradient(loss_name: str, mode: str) -> torch.Tensor:
    model, mb = TinyPolicy(), make_mini_batch()
    actor_critic_loss(model, mb, loss_name, mode, None).backward()
    return gradient(model)


# "gpg" is the same function as "reinforce"
LOSS_FUNCTIONS = sorted({POLICY_LOSSES.get(n): n for n in POLICY_LOSSES}.values())


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_name", LOSS_FUNCTIONS)
@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_gradient_independent_of_micro_batches(loss_name: str, mode: str, micro_batches: int) -> None:
    model, mb = TinyPolicy(), make_mini_batch()
    normalisers = mini_batch_normalisers(mb["response_mask"])
    for micro in split_rows(mb, micro_batches):  # gradient accumulation: losses are summed
        actor_critic_loss(model, micro, loss_name, mode, normalisers).backward()
    torch.testing.assert_close(gradient(model), full_gradient(loss_name, mode), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_name", LOSS_FUNCTIONS)
@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_gradient_independent_of_data_parallel_ranks(loss_name: str, mode: str, dp_size: int) -> None:
    """Each rank holds a replica and a shard of the rows; it accumulates 2 micro-batches; then the
    ranks' gradients are averaged, as DDP's all-reduce does."""
    mb = make_mini_batch()
    normalisers = mini_batch_normalisers(mb["response_mask"], dp_size=dp_size)
    rank_grads = []
    for shard in split_rows(mb, dp_size):
        replica = TinyPolicy()
        for micro in split_rows(shard, 2):
            actor_critic_loss(replica, micro, loss_name, mode, normalisers).backward()
        rank_grads.append(gradient(replica))
    averaged = torch.stack(rank_grads).mean(dim=0)
    torch.testing.assert_close(averaged, full_gradient(loss_name, mode), atol=1e-12, rtol=1e-10)


def test_shard_counts_add_up_to_the_mini_batch_normalisers() -> None:
    mask = make_mini_batch()["response_mask"]
    parts = [mini_batch_normalisers(m) for m in torch.tensor_split(mask, 3)]
    whole = mini_batch_normalisers(mask)
    assert sum(p.global_num_tokens for p in parts) == whole.global_num_tokens
    assert sum(p.global_num_seqs for p in parts) == whole.global_num_seqs


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_per_micro_batch_means_would_change_the_gradient(mode: str) -> None:
    """The bug the normalisers prevent: averaging per-micro-batch means weights tokens unequally."""
    model, mb = TinyPolicy(), make_mini_batch()
    micro_batches = split_rows(mb, 4)
    for micro in micro_batches:
        (actor_critic_loss(model, micro, "vanilla", mode, None) / len(micro_batches)).backward()
    assert not torch.allclose(gradient(model), full_gradient("vanilla", mode), atol=1e-6)
