"""Packed rows on the local layer spec take their rotary embedding at each token's position in its
own row, not at its column in the packed row: the same row gives the same log-probs wherever it is
packed, as far from float64 math as the padded layout's."""

from __future__ import annotations

import pytest
import torch

from _launch import run_distributed
from engine_helpers import VOCAB, hf_logprobs, save_hf_model

pytestmark = pytest.mark.distributed

ROWS, PROMPT, RESPONSE = 64, 20, 40


def _sharp_llama() -> torch.nn.Module:
    """A tiny Llama whose query and key weights are scaled up so that attention is sharp (scores of
    order 10, as in trained models): then an error in a rotation angle shows in the log-probs."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(12.0)
    return model


def _same_row_everywhere() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (1, PROMPT + RESPONSE), generator=torch.Generator().manual_seed(1)).repeat(ROWS, 1)
    mask = torch.ones_like(ids)
    return {"prompts": ids[:, :PROMPT], "responses": ids[:, PROMPT:], "input_ids": ids, "attention_mask": mask,
            "position_ids": mask.cumsum(1) - 1, "response_mask": mask[:, PROMPT:].float()}


def _log_probs(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    spec = ModelSpec.from_hf_config(hf_dir)
    out = {}
    for name, cfg in (("packed", dict(micro_batch_size=ROWS, use_sequence_packing=True)),
                      ("padded", dict(micro_batch_size=8))):
        engine = MegatronEngine(spec, ParallelLayout(), EngineConfig(trained=False, prompt_sharing="never", **cfg))
        engine.load_hf_weights(hf_dir)
        micro = engine._micro_batches(batch, forward_only=True)
        out[name] = (engine.compute_log_prob(batch)["log_probs"], len(micro), int(micro[0]["tokens"].shape[1]))
    return out


def test_a_row_packed_far_from_column_0_has_the_log_probs_of_the_row_alone() -> None:
    model = _sharp_llama()
    batch = _same_row_everywhere()
    reference, _ = hf_logprobs(model, {k: v[:1] for k, v in batch.items()})  # float64, one row
    out = run_distributed(_log_probs, 1, save_hf_model(model), batch)[0]
    packed, micro_batches, width = out["packed"]
    assert (micro_batches, width) == (1, ROWS * (PROMPT + RESPONSE))  # one packed row of 3,840 columns
    padded_error = (out["padded"][0].double() - reference).abs().amax(dim=1)
    packed_error = (packed.double() - reference).abs().amax(dim=1)
    # Rows at columns 0..59 in both layouts: float32 rounding alone (measured 4-7e-7 on either). With
    # the rotation taken at the packed column, the last row (column 3,780) was ~1e-5 off: its angle
    # error grows with the column, about column * 2**-24 rad.
    assert float(packed_error.max()) <= 4 * float(padded_error.max()), (packed_error.max(), padded_error.max())
    assert float(packed_error[-1]) <= 4 * float(padded_error[-1])
