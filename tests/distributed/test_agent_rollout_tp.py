"""Multi-turn rollout at rollout TP=2 over real gloo processes: the rollout TP group's first rank runs
the agent loop and the tools, the other rank makes the same batched engine calls from the plans it
receives (a tensor-parallel engine needs every rank in every call), and both return the same batch.

The engine is a scripted stand-in (the same script on both ranks, recording its calls), so the test
checks the loop's distribution of work, not a model; the follower's tools raise if ever called.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import run_distributed  # noqa: E402

pytestmark = pytest.mark.distributed

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "EXPR"}}</tool_call><|im_end|>'


class ScriptedEngine:
    """First turn: a calculator call on the prompt's expression; after a tool turn: its answer."""

    def __init__(self, tokenizer: Any, options: Any) -> None:
        self.tokenizer, self.options, self.calls = tokenizer, options, []

    def generate_tokens(self, contexts: Any, params: Any, max_new_tokens: Any = None) -> list:
        from megarl.rollout.base import TokenContinuation

        self.calls.append([list(c) for c in contexts])
        outs = []
        for context, budget in zip(contexts, max_new_tokens):
            text = self.tokenizer.decode(context, skip_special_tokens=False)
            if "<|im_start|>tool\n" in text:
                turn = text.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0] + "<|im_end|>"
            else:
                turn = CALL.replace("EXPR", text.split("<|im_start|>user\n")[1].split("=")[0])
            ids = self.tokenizer.encode(turn, add_special_tokens=False)[:budget]
            outs.append(TokenContinuation(ids, [-0.5] * len(ids), ids[-1] == self.tokenizer.eos_token_id))
        return outs


def _rollout(rank: int, world: int, port: int, tokenizer_dir: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from megarl.agent.loop import AgentSettings
    from megarl.data.tokenizer import load_tokenizer
    from megarl.protocol import Batch
    from megarl.rollout.base import EngineOptions, SamplingParams
    from megarl.workers.roles import RolloutRole
    from megarl.workers.specs import RolloutSpec

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tokenizer = load_tokenizer(tokenizer_dir)
    options = EngineOptions(pad_token_id=0, eos_token_ids=(tokenizer.eos_token_id,))
    spec = RolloutSpec(model_dir=tokenizer_dir, engine="hf", options=options, tensor_parallel_size=2,
                       multi_turn=AgentSettings(max_response_length=120, tools=("calculator",)))
    role = RolloutRole(SimpleNamespace(rank=rank), spec)
    role.engine = ScriptedEngine(tokenizer, options)
    loop = role._agent_loop()
    if rank == 1:
        def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("a follower rank ran a tool")
        loop.tools.call = refuse
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": e}], tokenize=False,
                                             add_generation_prompt=True) for e in ("12+30=", "7*6=")]
    rows = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    width = max(map(len, rows))
    ids = torch.zeros((2, width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": mask},
                            {"extra_info": [{"tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": 42}}}}] * 2})
    out = role.generate(batch, SamplingParams(n=2, max_new_tokens=120))
    return {"calls": role.engine.calls, "responses": out["responses"], "response_mask": out["response_mask"],
            "tool_reward": out["tool_reward"], "turns": out["agent/num_turns"]}


def test_the_driver_runs_the_loop_and_the_follower_makes_the_same_engine_calls(tmp_path: Path) -> None:
    from megarl.data.tokenizer import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, build_char_tokenizer

    import string

    tok = build_char_tokenizer(string.printable, tmp_path / "tok", chat_template=CHATML_TEMPLATE,
                               extra_special_tokens=(*CHATML_SPECIAL_TOKENS, "<tool_call>", "</tool_call>"))
    tok.eos_token = "<|im_end|>"
    tok.save_pretrained(str(tmp_path / "tok"))
    driver, follower = run_distributed(_rollout, 2, str(tmp_path / "tok"), timeout=240)
    assert driver["calls"] == follower["calls"]
    assert len(driver["calls"][0]) == 4  # 2 prompts x n=2 in one batched call
    # Each episode's answer turn is generated once, in whichever round its tool call was done by.
    assert sum(len(c) for c in driver["calls"]) == 8
    for key in ("responses", "response_mask", "tool_reward", "turns"):
        assert driver[key].equal(follower[key]), key
    assert driver["tool_reward"].tolist() == [1.0, 1.0, 1.0, 1.0]  # 12+30 and 7*6 are both 42
    assert driver["turns"].tolist() == [2.0] * 4
