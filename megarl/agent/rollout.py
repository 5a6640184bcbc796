"""Multi-turn rollout of a prompt batch: the agent loop's episodes as the trainer's rollout batch.

The batch has the columns of `megarl.rollout.output` with these differences:
- ``responses``: the whole conversation after the prompt (model turns and tool-role turns);
- ``response_mask``: 1 on the model's tokens, 0 on tool-output tokens and on padding, so every loss,
  KL and advantage term sees only what the model produced;
- ``attention_mask``: 1 on every real token, tool outputs included (the model reads them);
- ``rollout_log_probs``: the engine's log-probs on model tokens, 0 on tool tokens;
and per-row float columns: ``tool_reward`` (the sum of the tools' `calc_reward`, which the reward
manager adds to the score) and ``agent/{num_turns,tool_calls,tool_errors,tool_timeouts,tool_seconds,
retokenize_mismatch}`` (summarised by `agent_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megarl.agent.chat import retokenize_mismatch
from megarl.agent.loop import AgentLoop, Episode, parse_tools_kwargs
from megarl.errors import DataError
from megarl.protocol import Batch
from megarl.rollout.base import SamplingParams
from megarl.rollout.output import assemble_rollout_batch, pad_responses, unpad_prompts

EPISODE_COLUMNS = ("num_turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_seconds", "retokenize_mismatch")


def rows_tools_kwargs(prompts: Batch, loop: AgentLoop) -> list[dict[str, dict[str, Any]]]:
    """Each prompt row's `extra_info.tools_kwargs` (verl's layout), checked against the run's tools. A
    problem names the row by the identity the batch carries (`uid`, dataset `index`): its position here
    is only its place in this rank's shard."""
    extra = prompts["extra_info"] if "extra_info" in prompts.keys() else [None] * len(prompts)
    out = []
    for i, e in enumerate(extra):
        if e is not None and not isinstance(e, dict):
            raise DataError(f"{_row_identity(prompts, i)}: extra_info must be a mapping (holding tools_kwargs: "
                            f"{{tool: {{create_kwargs: ...}}}}) or null, got {type(e).__name__}")
        try:
            out.append(parse_tools_kwargs((e or {}).get("tools_kwargs"), loop.tools.tools))
        except ValueError as exc:
            raise DataError(f"{_row_identity(prompts, i)}: extra_info.{exc}") from None
    return out


def _row_identity(prompts: Batch, i: int) -> str:
    """How a message names prompt row `i`: its uid and dataset index where the batch has them."""
    keys = prompts.keys()
    named = ([f"uid '{prompts['uid'][i]}'"] if "uid" in keys else []) + \
        ([f"dataset index {prompts['index'][i]}"] if "index" in keys else [])
    return f"prompt {', '.join(named)}" if named else f"row {i} of the prompt batch"


def multi_turn_generate(loop: AgentLoop, prompts: Batch, params: SamplingParams, driver: bool = True,
                        share: Callable[[Any], Any] = lambda obj: obj) -> Batch:
    """`params.n` episodes per prompt row (rows i*n .. i*n+n-1 of the result belong to prompt i);
    responses right-padded to `loop.settings.max_response_length`."""
    n, width = params.n, loop.settings.max_response_length
    ids = [p for p in unpad_prompts(prompts["input_ids"], prompts["attention_mask"]) for _ in range(n)]
    kwargs = [k for k in rows_tools_kwargs(prompts, loop) for _ in range(n)]
    episodes = loop.run(ids, kwargs, params, driver=driver, share=share)
    return episodes_to_batch(episodes, prompts, n, width, loop.engine.options.pad_token_id, loop.tokenizer)


def episodes_to_batch(episodes: list[Episode], prompts: Batch, n: int, width: int, pad_token_id: int,
                      tokenizer: Any) -> Batch:
    responses, log_probs, lengths = pad_responses([e.response_ids for e in episodes], [e.log_probs for e in episodes],
                                                  width, pad_token_id)
    out = assemble_rollout_batch(prompts, responses, lengths, log_probs, n, pad_token_id)
    model_mask = torch.zeros_like(out["response_mask"])
    for row, ep in enumerate(episodes):
        model_mask[row, :len(ep.response_mask)] = torch.as_tensor(ep.response_mask[:width], dtype=model_mask.dtype)
    out["response_mask"] = model_mask
    out["rollout_log_probs"] = out["rollout_log_probs"] * model_mask
    out["tool_reward"] = torch.tensor([e.tool_reward for e in episodes], dtype=torch.float32)
    mismatch = [retokenize_mismatch(tokenizer, e.prompt_ids + e.response_ids) for e in episodes]
    values = {"num_turns": [e.turns for e in episodes], "tool_calls": [e.tool_calls for e in episodes],
              "tool_errors": [e.tool_errors for e in episodes], "tool_timeouts": [e.tool_timeouts for e in episodes],
              "tool_seconds": [e.tool_seconds for e in episodes], "retokenize_mismatch": mismatch}
    for name in EPISODE_COLUMNS:
        out[f"agent/{name}"] = torch.tensor(values[name], dtype=torch.float32)
    return out


def agent_metrics(batch: Batch) -> dict[str, float]:
    """Per-step summaries of the multi-turn columns (empty when the batch has none)."""
    if "agent/num_turns" not in batch:
        return {}
    turns, calls = batch["agent/num_turns"], batch["agent/tool_calls"]
    total_calls = float(calls.sum())
    return {
        "agent/turns/mean": float(turns.mean()), "agent/turns/max": float(turns.max()),
        "agent/tool_calls/mean": float(calls.mean()), "agent/tool_calls/max": float(calls.max()),
        "agent/tool_call_rate": float((calls > 0).float().mean()),
        "agent/tool_errors": float(batch["agent/tool_errors"].sum()),
        "agent/tool_timeouts": float(batch["agent/tool_timeouts"].sum()),
        "agent/tool_latency_s/mean": float(batch["agent/tool_seconds"].sum()) / total_calls if total_calls else 0.0,
        "agent/tool_reward/mean": float(batch["tool_reward"].mean()),
        "agent/retokenize_mismatch": float(batch["agent/retokenize_mismatch"].mean()),
    }
