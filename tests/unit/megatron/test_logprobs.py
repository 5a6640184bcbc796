"""Log-prob and entropy from (vocab-padded) logits against a float64 log_softmax, values and grads."""

from __future__ import annotations

import torch

from megarl.megatron.logprobs import vocab_parallel_logprobs_entropy


def test_matches_log_softmax_and_ignores_padded_vocab() -> None:
    torch.manual_seed(0)
    vocab, padded = 10, 16
    logits = torch.randn(3, 5, padded, requires_grad=True)
    targets = torch.randint(0, vocab, (3, 5))
    lp, ent = vocab_parallel_logprobs_entropy(logits, targets, 0, vocab, temperature=0.8, with_entropy=True)

    ref_logits = (logits[..., :vocab].double() / 0.8)
    logp = torch.log_softmax(ref_logits, -1)
    ref_lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = torch.zeros(3, 5, dtype=torch.float64)
    for b in range(3):
        for s in range(5):
            p = logp[b, s].exp()
            ref_ent[b, s] = -sum(p[v] * logp[b, s, v] for v in range(vocab))
    assert torch.allclose(lp.double(), ref_lp, atol=1e-6)
    assert torch.allclose(ent.double(), ref_ent, atol=1e-6)

    (lp.sum() + ent.sum()).backward()
    grad = logits.grad.clone()
    logits.grad = None
    ref = logits.double()[..., :vocab] / 0.8
    logp = torch.log_softmax(ref, -1)
    (logp.gather(-1, targets.unsqueeze(-1)).sum() - (logp.exp() * logp).sum()).backward()
    assert torch.allclose(grad.double(), logits.grad.double(), atol=1e-6)
    assert torch.all(grad[..., vocab:] == 0)


def test_slice_offset_picks_targets_owned_by_this_slice_only() -> None:
    logits = torch.zeros(1, 1, 4)
    # This slice holds vocab ids 4..7 of 8; target 1 is owned elsewhere: its logit contribution is 0.
    lp, _ = vocab_parallel_logprobs_entropy(logits, torch.tensor([[1]]), vocab_start=4, vocab_size=8)
    assert torch.allclose(lp, torch.tensor([[-torch.log(torch.tensor(4.0))]]))
