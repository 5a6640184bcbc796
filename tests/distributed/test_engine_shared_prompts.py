"""Shared-prompt micro-batches (`model.prompt_sharing`): rows with the same prompt computed as one
sequence give the log-probs, entropy, values and gradient of HF transformers run on every row
alone (float64), and the model sees one sequence per prompt.

The batch holds groups of rows with one prompt and different responses of varied lengths (GRPO's
layout), a prompt that is another group's prompt without its first tokens (a different prompt: it
must not share), and micro-batches that cut a group in two.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _launch import run_distributed
from engine_helpers import (
    GRAD_RTOL, VOCAB, gather_hf_grads, hf_logprobs, hf_weight_names, make_hf_model, pg_loss_fn,
    reference_gradients, relative_error, save_hf_model,
)

pytestmark = pytest.mark.distributed

PROMPT_W, RESPONSE_W = 6, 5


def grouped_batch(seed: int) -> dict[str, torch.Tensor]:
    """Prompts (left-padded) shared by 3, 2, 1 and 3 rows; the third prompt is the first one's tail."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 6, 2)]
    prompts.insert(2, prompts[0][2:])  # a proper suffix of prompt 0: another prompt, same last tokens
    members = [0, 0, 0, 1, 1, 2, 3, 3, 3]
    rows = len(members)
    input_ids = torch.zeros(rows, PROMPT_W + RESPONSE_W, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, group in enumerate(members):
        prompt = prompts[group]
        valid = int(torch.randint(1, RESPONSE_W + 1, (1,), generator=g))
        input_ids[i, PROMPT_W - len(prompt):PROMPT_W] = torch.tensor(prompt)
        input_ids[i, PROMPT_W:PROMPT_W + valid] = torch.randint(0, VOCAB, (valid,), generator=g)
        mask[i, PROMPT_W - len(prompt):PROMPT_W + valid] = 1
    return {
        "prompts": input_ids[:, :PROMPT_W], "responses": input_ids[:, PROMPT_W:], "input_ids": input_ids,
        "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": mask[:, PROMPT_W:].float(),
        "advantages": torch.randn(rows, RESPONSE_W, generator=g),
    }


def _engine(hf_dir: str, **cfg: Any) -> Any:
    from megarl.layout import ParallelLayout
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.models.spec import ModelSpec

    return MegatronEngine(ModelSpec.from_hf_config(hf_dir), ParallelLayout(), EngineConfig(**cfg))


def _shared_passes(rank: int, world: int, port: int, hf_dir: str, batch: dict, head: torch.Tensor) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed
    from megarl.models.weight_map import read_hf_tensors

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    out: dict[str, Any] = {}
    for mode in ("always", "never"):
        # micro-batches of 4 rows cut prompt 0's group (rows 0-2 | 3-5 | 6-8 keeps prompt 3 whole)
        engine = _engine(hf_dir, micro_batch_size=4, log_prob_micro_batch_size=4, prompt_sharing=mode,
                         clip_grad=1e9)
        engine.load_hf_weights(hf_dir)
        shapes: list[tuple[int, int]] = []
        engine.model.embedding.register_forward_pre_hook(
            lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
        out[mode] = engine.compute_log_prob(batch, temperature=1.3, calculate_entropy=True)
        out[mode]["input_shapes"] = list(shapes)
        engine.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]), calculate_entropy=True)
        out[mode]["grads"] = gather_hf_grads(engine)
    critic = _engine(hf_dir, micro_batch_size=4, log_prob_micro_batch_size=4, prompt_sharing="always", role="value")
    weights = read_hf_tensors(hf_dir, [n for n in hf_weight_names(hf_dir) if n != "lm_head.weight"])
    critic.load_hf_state_dict({**weights, "score.weight": head})
    out["values"] = critic.compute_values(batch)
    return out


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_shared_prompt_rows_equal_hf_row_by_row(kind: str) -> None:
    model = make_hf_model(kind, seed=7)
    hf_dir = save_hf_model(model)
    batch = grouped_batch(seed=5)
    mask = batch["response_mask"].bool()
    head = torch.randn(1, 64, generator=torch.Generator().manual_seed(2)) * 0.1
    got = run_distributed(_shared_passes, 1, hf_dir, batch, head)[0]
    ref_lp, ref_ent = hf_logprobs(model, batch, temperature=1.3)
    for mode in ("always", "never"):
        lp_err = (got[mode]["log_probs"].double() - ref_lp)[mask].abs().max().item()
        ent_err = (got[mode]["entropys"].double() - ref_ent)[mask].abs().max().item()
        assert lp_err < 1e-5 and ent_err < 1e-5, f"{kind} {mode}: errors {lp_err}, {ent_err}"
    # Shared: micro-batch 1 (rows 0-3) is prompt 0 (3 rows) + prompt 1 (1 row): 2 sequences, the
    # longest 4 + three responses; micro-batch 2 (rows 4-7): prompts 1, 2, 3; micro-batch 3: prompt 3.
    lengths = batch["attention_mask"][:, PROMPT_W:].sum(1).tolist()
    first = (2, 4 + sum(lengths[0:3]))
    assert got["always"]["input_shapes"][0] == first, got["always"]["input_shapes"]
    assert [s[0] for s in got["always"]["input_shapes"]] == [2, 3, 1]
    assert [s[0] for s in got["never"]["input_shapes"]] == [4, 4, 1]
    # The gradient of one update equals the float64 reference's, shared or not.
    exact = reference_gradients(model, batch)
    for mode in ("always", "never"):
        assert relative_error(got[mode]["grads"], exact) < GRAD_RTOL, mode
    # Values: HF's last hidden states times the value head, at the positions before each response token.
    with torch.no_grad():
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"]).last_hidden_state.double()
    want_values = (hidden @ head.double().T)[..., 0][:, PROMPT_W - 1:PROMPT_W + RESPONSE_W - 1]
    assert (got["values"].double() - want_values)[mask].abs().max().item() < 1e-5


def _always_refused(rank: int, world: int, port: int, hf_dir: str) -> str:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(cp=2))
    try:
        _engine(hf_dir, prompt_sharing="always")
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return "built"


def test_always_is_refused_where_it_cannot_share() -> None:
    hf_dir = save_hf_model(make_hf_model("qwen2", seed=1))
    results = run_distributed(_always_refused, 2, hf_dir)
    assert all(r.startswith("ConfigError") and "context parallelism" in r for r in results), results
