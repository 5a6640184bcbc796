"""The agent loop over the vLLM engine (CPU build here): the same multi-turn episodes as over the HF
engine, token for token, with the same masks and log-probs.

The model is a tiny Qwen2 (head_dim 64, as the CPU build needs) fitted for a few seconds on
calculator demonstrations (megarl.agent.warm_start), so greedy decoding makes real tool calls.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
vllm = pytest.importorskip("vllm", reason="needs vLLM: build the CPU environment with tools/vllm_env.sh")

from megarl.agent.loop import AgentLoop, AgentSettings  # noqa: E402
from megarl.agent.rollout import multi_turn_generate  # noqa: E402
from megarl.agent.tools import ToolSet  # noqa: E402
from megarl.agent.warm_start import conversation_ids, fit_demonstrations  # noqa: E402
from megarl.data.padding import left_pad  # noqa: E402
from megarl.data.tasks.arithmetic_tools import ArithmeticToolsTask, build_tools_tokenizer, call_text  # noqa: E402
from megarl.data.tokenizer import load_tokenizer  # noqa: E402
from megarl.protocol import Batch  # noqa: E402
from megarl.rollout import EngineOptions, SamplingParams  # noqa: E402
from megarl.rollout.hf_engine import HFRolloutEngine  # noqa: E402
from megarl.rollout.vllm_engine import VLLMRolloutEngine  # noqa: E402

pytestmark = pytest.mark.vllm

CONFIG = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp_path = tmp_path_factory.mktemp("warm")
    tokenizer = build_tools_tokenizer(tmp_path / "tokenizer")
    task = ArithmeticToolsTask(digits=3)
    rng = random.Random(0)
    demos = []
    for _ in range(512):
        expression, answer = task.sample(rng)
        demos.append(conversation_ids(tokenizer, expression + "=", [call_text(expression), f"{answer}<|im_end|>"],
                                      [str(answer)]))
    fit_demonstrations(CONFIG, tokenizer, demos, tmp_path / "model", steps=120)
    return tmp_path / "model"


def engine_options(tokenizer: Any) -> EngineOptions:
    return EngineOptions(pad_token_id=tokenizer.pad_token_id, eos_token_ids=(tokenizer.eos_token_id,),
                         max_model_len=256, max_num_seqs=16, kv_cache_memory_gb=0.25, sleep_level=1)


@pytest.fixture(scope="module")
def vllm_engine(warm_model: Path) -> Iterator[VLLMRolloutEngine]:
    engine = VLLMRolloutEngine(warm_model, engine_options(load_tokenizer(warm_model)))
    yield engine
    engine.release()


def test_token_budgets_per_request_match_the_hf_engine(warm_model: Path, vllm_engine: VLLMRolloutEngine) -> None:
    tokenizer = load_tokenizer(warm_model)
    contexts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": e}], tokenize=False,
                                                               add_generation_prompt=True), add_special_tokens=False)
                for e in ("123+456=", "321+654=", "500+500=")]
    greedy = SamplingParams.make_greedy(40)
    out = vllm_engine.generate_tokens(contexts, greedy, [3, 40, 7])
    ref = HFRolloutEngine.from_pretrained(warm_model, engine_options(tokenizer), device="cpu").generate_tokens(
        contexts, greedy, [3, 40, 7])
    assert [len(o.token_ids) for o in out] == [3, len(ref[1].token_ids), 7]
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert [o.stopped for o in out] == [False, True, False]  # the call turn ends on <|im_end|> within 40
    for o, r in zip(out, ref):
        torch.testing.assert_close(torch.tensor(o.log_probs), torch.tensor(r.log_probs), atol=1e-4, rtol=0)


def test_multi_turn_episodes_match_the_hf_engine(warm_model: Path, vllm_engine: VLLMRolloutEngine) -> None:
    tokenizer = load_tokenizer(warm_model)
    task = ArithmeticToolsTask(digits=3)
    rows = list(task.rows(8, 1, "val"))
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False) for r in rows]
    ids, mask, _ = left_pad(prompts, tokenizer.pad_token_id)
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": mask}, {"extra_info": [r["extra_info"] for r in rows]})
    options = engine_options(tokenizer)
    settings = AgentSettings(max_response_length=80, max_turns=3)
    greedy = SamplingParams.make_greedy(80)

    out = multi_turn_generate(AgentLoop(vllm_engine, tokenizer, ToolSet.from_names(["calculator"]), settings),
                              batch, greedy)
    hf_engine = HFRolloutEngine.from_pretrained(warm_model, options, device="cpu")
    ref = multi_turn_generate(AgentLoop(hf_engine, tokenizer, ToolSet.from_names(["calculator"]), settings),
                              batch, greedy)

    assert out["agent/tool_calls"].sum() > 0 and out["tool_reward"].sum() > 0  # real calls, some right
    assert out["agent/num_turns"].max() >= 2
    for key in ("responses", "response_mask", "attention_mask", "tool_reward", "agent/num_turns"):
        assert torch.equal(out[key], ref[key]), key
    torch.testing.assert_close(out["rollout_log_probs"], ref["rollout_log_probs"], atol=1e-4, rtol=0)
    assert out["agent/retokenize_mismatch"].sum() == 0
