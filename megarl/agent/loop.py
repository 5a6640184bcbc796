"""The per-request agent loop of multi-turn rollouts: generate, call tools, generate again.

Each request (one sample of one prompt) is its own state machine:

    PENDING -> GENERATING -> (turn ended with tool calls) CALLING_TOOLS -> GENERATING -> ... -> DONE

A round gives every GENERATING request its next turn in one batched engine call
(`generate_tokens`, token ids in and out). Tool calls run in a thread pool: a request whose tools
are still running need not hold the others. With `wait_for_tools` (the default) each round waits for
every running call first, so which requests share a round, and so the sampled tokens, never depend on
how fast a tool answered, and one request's calls of a turn run one after another in the order
written, so a tool's per-request state follows that order: a run with a fixed seed is reproducible.
Without it, a turn's calls run together, requests whose tools answered generate their next turns
meanwhile and the loop waits for tools only when no request is ready to generate (faster with slow
tools; rounds and tool state then depend on timing). Every round samples a request from its own
row's random stream (`SamplingParams.prompt_indices`), whichever requests are still running.

Limits: `max_turns` assistant turns, a response budget of `max_response_length` tokens over all
turns (model and tool tokens), `max_parallel_calls` calls run per turn (as verl's key; each later
call of the turn is answered that it was not run, so every call gets its answer in the order
written), and a timeout per tool call (a call past it answers the model with a timeout error; its
thread is left to finish, and the sandboxed interpreter has its own wall-clock limit).

Token-in, token-out: the response is the engine's ids exactly as sampled (mask 1, with their
log-probs) and the tool-role turns tokenised once by `ToolTurnEncoder` (mask 0, log-prob 0).

With a tensor-parallel engine every rank of the engine must make the same engine calls: one rank
(`driver=True`) runs the state machine and the tools, and `share` (a broadcast from it over the
engine's ranks) hands each round's plan and the final episodes to the others, which only generate.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from megarl.agent.chat import ToolTurnEncoder
from megarl.agent.parsers import ParseError, ToolCall, get_parser
from megarl.agent.tools import ToolResult, ToolSet
from megarl.rollout.base import SamplingParams, TokenContinuation

TOOL_KWARGS_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")


class TokenGenerator(Protocol):
    def generate_tokens(self, contexts: Sequence[Sequence[int]], params: SamplingParams,
                        max_new_tokens: Sequence[int] | None = None) -> list[TokenContinuation]: ...


class Phase(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    CALLING_TOOLS = "calling_tools"
    DONE = "done"


TRUNCATION_MARK = "...(truncated)..."


def cut_tool_output(text: str, cap: int, side: str) -> str:
    """`text` cut to `cap` characters where longer, with a mark where text was left out, so the model
    can tell a cut output from a whole one. `side`: the part kept, left (the start), right (the end)
    or middle (both ends, the middle left out), as verl's `tool_response_truncate_side`."""
    if len(text) <= cap:
        return text
    if side == "left":
        return text[:cap] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[len(text) - cap:]
    if side == "middle":
        head = (cap + 1) // 2
        return text[:head] + TRUNCATION_MARK + text[len(text) - (cap - head):]
    raise ValueError(f"tool_response_truncate_side must be left, middle or right, got {side!r}")


@dataclass(frozen=True)
class AgentSettings:
    """Limits of one episode (`rollout.multi_turn.*`). Lengths in tokens unless named otherwise."""

    max_turns: int = 4  # assistant turns
    max_response_length: int = 64  # model and tool tokens together, over all turns
    tool_timeout_s: float = 10.0  # per call
    max_parallel_calls: int = 8  # calls of one turn that run; later ones are answered "not run"
    max_tool_response_chars: int = 256  # a longer tool output is cut (`cut_tool_output`)
    tool_response_truncate_side: str = "middle"  # left | middle | right: the part of a cut output kept
    format: str = "hermes"  # tool-call parser
    tools: tuple[str, ...] = ()  # tool names for `ToolSet.from_names` (the roles build the set)
    wait_for_tools: bool = True  # rounds wait for every running call; a turn's calls run in order (reproducible)
    tool_threads: int = 16  # threads running the tool calls of all requests (not a config key)
    # data.apply_chat_template_kwargs: the tool turn is rendered with them, as the prompt was
    chat_template_kwargs: Optional[dict[str, Any]] = None


@dataclass
class _Call:
    name: str
    future: Optional[concurrent.futures.Future]  # None: not queued yet (`run`), or answered already
    submitted: float  # time.monotonic() when the call was queued
    answer: Optional[ToolResult] = None  # set from the start for a malformed call or one not run
    started: Optional[float] = None  # when a thread began running it (set by that thread)
    run: Optional[Callable[[], ToolResult]] = None  # what a thread runs, until it is queued


@dataclass
class Episode:
    """One request's conversation after the prompt, and what happened in it."""

    row: int
    episode_id: str
    prompt_ids: list[int]
    tools_kwargs: dict[str, dict[str, Any]]
    phase: Phase = Phase.PENDING
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)  # 1 model token, 0 tool-output token
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_seconds: float = 0.0
    tool_reward: float = 0.0
    finish_reason: str = ""  # stop | length | max_turns
    calls: list[_Call] = field(default_factory=list)

    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def append(self, ids: Sequence[int], model: bool, log_probs: Sequence[float] | None = None) -> None:
        self.response_ids += list(ids)
        self.response_mask += [int(model)] * len(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)


def encodable(text: str) -> str:
    """`text` with what UTF-8 cannot encode written as backslash escapes (`\\ud800`). A model can write
    a lone surrogate as a JSON escape in a tool call (`{"name": "\\ud800"}`), error messages quote the
    call back, and a tokenizer refuses such a string: the step would fail on the model's own output."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def parse_tools_kwargs(value: Any, tool_names: Collection[str]) -> dict[str, dict[str, Any]]:
    """A row's `extra_info.tools_kwargs` (verl's layout): {tool: {create_kwargs|execute_kwargs|calc_reward_kwargs|
    release_kwargs: {...}}}, each tool one of `tool_names`; {} for None. ValueError saying what is wrong
    (the caller names the row)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"tools_kwargs must be a mapping tool -> kwargs, got {type(value).__name__}")
    # Parquet stores the rows' dicts as one struct type: keys a row lacks come back as None.
    value = {name: kwargs for name, kwargs in value.items() if kwargs is not None}
    for name, kwargs in value.items():
        if name not in tool_names:
            raise ValueError(f"tools_kwargs names tool {name!r}; the run's tools (rollout.multi_turn.tools) are "
                             f"{sorted(tool_names)}")
        if not isinstance(kwargs, dict):
            raise ValueError(f"tools_kwargs.{name} must be a mapping of {list(TOOL_KWARGS_KEYS)}, got "
                             f"{type(kwargs).__name__}")
        bad = [k for k in kwargs if k not in TOOL_KWARGS_KEYS]
        if bad:
            raise ValueError(f"tools_kwargs.{name} may hold only {list(TOOL_KWARGS_KEYS)} (mappings); got {bad}")
        for key, kw in kwargs.items():
            if kw is not None and not isinstance(kw, dict):
                raise ValueError(f"tools_kwargs.{name}.{key} must be a mapping of keyword arguments, got "
                                 f"{type(kw).__name__}")
    return {name: {key: dict(kw or {}) for key, kw in kwargs.items()} for name, kwargs in value.items()}


class AgentLoop:
    """Runs episodes over one engine and one tool set (see the module doc)."""

    def __init__(self, engine: TokenGenerator, tokenizer: Any, tools: ToolSet, settings: AgentSettings,
                 encoder: Optional[ToolTurnEncoder] = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.tools = tools
        self.settings = settings
        self.encoder = encoder if encoder is not None else ToolTurnEncoder(tokenizer, settings.chat_template_kwargs)
        self.parser = get_parser(settings.format)
        self._pool = concurrent.futures.ThreadPoolExecutor(settings.tool_threads, thread_name_prefix="tool")
        self._last_start = 0.0  # time.monotonic() when a tool call last began running (any thread)
        self.engine_calls = 0  # batched generate_tokens calls made (for tests and profiling)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def run(self, prompts: Sequence[Sequence[int]], tools_kwargs: Sequence[dict[str, dict[str, Any]]],
            params: SamplingParams, driver: bool = True,
            share: Callable[[Any], Any] = lambda obj: obj) -> list[Episode]:
        """One episode per prompt (ids without padding); episode i samples as row
        `params.row_offset` + i of the whole batch (`params.n` is ignored). Every rank of the engine
        calls this; only the `driver`'s arguments besides `params` are used, and `share(obj)` must
        return the driver's `obj` on every rank."""
        episodes = [Episode(i, uuid.uuid4().hex, list(p), kw) for i, (p, kw) in enumerate(zip(prompts, tools_kwargs))] \
            if driver else []
        if driver:
            for ep in episodes:
                for name, tool in self.tools.tools.items():
                    tool.create(ep.episode_id, **ep.tools_kwargs.get(name, {}).get("create_kwargs", {}))
                ep.phase = Phase.GENERATING
        rounds = 0
        try:
            while True:
                plan = self._plan(episodes) if driver else None
                plan = share(plan)
                if plan is None:
                    break
                rows, contexts, budgets = plan
                seed = None if params.seed is None else params.seed + 7919 * rounds
                # Every round samples each request from its own row's stream (`params.row_offset` +
                # its row), whichever others are still running: a seeded batch samples the same
                # whatever its split over ranks.
                turn = dataclasses.replace(params, n=1, seed=seed,
                                           prompt_indices=tuple(params.row_offset + row for row in rows))
                outs = self.engine.generate_tokens(contexts, turn, budgets)
                self.engine_calls += 1
                rounds += 1
                if driver:
                    for row, out in zip(rows, outs):
                        self._absorb(episodes[row], out)
            if driver:
                for ep in episodes:
                    self._finish(ep)
        except BaseException:
            if driver:
                for ep in episodes:
                    self._release(ep)
            raise
        return share(episodes if driver else None)

    # -- the state machine (driver only) --------------------------------------------------------
    def _plan(self, episodes: list[Episode]) -> Optional[tuple[list[int], list[list[int]], list[int]]]:
        """The requests to generate this round: (rows, contexts, token budgets); None when all are done.
        Waits for every running tool call first (`wait_for_tools`), or only when no request could
        generate meanwhile."""
        while True:
            for ep in episodes:
                if ep.phase is Phase.CALLING_TOOLS:
                    self._collect(ep)
            ready = [ep for ep in episodes if ep.phase is Phase.GENERATING]
            calling = [c for ep in episodes if ep.phase is Phase.CALLING_TOOLS for c in ep.calls
                       if c.answer is None and c.future is not None]
            if ready and not (calling and self.settings.wait_for_tools):
                return ([ep.row for ep in ready], [ep.context() for ep in ready],
                        [self.settings.max_response_length - len(ep.response_ids) for ep in ready])
            if not calling:
                return None
            wait = max(0.0, min(self._deadline(c) for c in calling) - time.monotonic())
            concurrent.futures.wait([c.future for c in calling], timeout=wait,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def _absorb(self, ep: Episode, out: TokenContinuation) -> None:
        """A generated turn: append it, then end the episode or start its tool calls."""
        ep.append(out.token_ids, model=True, log_probs=out.log_probs)
        ep.turns += 1
        if not out.stopped:
            return self._done(ep, "length")
        turn = self.parser.parse(self.tokenizer.decode(out.token_ids, skip_special_tokens=False))
        if not turn.has_calls:
            return self._done(ep, "stop")
        if ep.turns >= self.settings.max_turns:
            return self._done(ep, "max_turns")
        if len(ep.response_ids) >= self.settings.max_response_length:
            return self._done(ep, "length")
        # One answer per call, in the order the calls were written: the answers carry no call id
        # (Hermes/Qwen tool responses), the model pairs them with its calls by position. At most
        # `max_parallel_calls` well-formed calls of the turn run (verl's meaning of the key); each later
        # one is answered that it was not run (verl drops them, which would shift the pairing).
        now, cap, ran = time.monotonic(), self.settings.max_parallel_calls, 0
        ep.calls = []
        for item in turn.in_order():
            if isinstance(item, ParseError):
                ep.calls.append(_Call("", None, now, ToolResult(f"error: {item.message}", error="parse")))
            elif ran >= cap:
                ep.calls.append(_Call(item.name, None, now, ToolResult(
                    f"error: {item.name} was not run: a turn runs at most {cap} tool call{'s' * (cap != 1)} "
                    "(rollout.multi_turn.max_parallel_calls)", error="not_run")))
            else:
                ep.calls.append(self._submit(ep, item, now))
                ran += 1
        ep.phase = Phase.CALLING_TOOLS
        self._collect(ep)

    def _submit(self, ep: Episode, call: ToolCall, submitted: float) -> _Call:
        """A call to run; `_collect` queues it (in turn, with `wait_for_tools`)."""
        kwargs = ep.tools_kwargs.get(call.name, {}).get("execute_kwargs", {})
        record = _Call(call.name, None, submitted)

        def run() -> ToolResult:
            record.started = self._last_start = time.monotonic()
            return self.tools.call(ep.episode_id, call.name, call.arguments, **kwargs)

        record.run = run
        return record

    def _deadline(self, call: _Call) -> float:
        """When `call` is answered with a timeout error: `tool_timeout_s` after it began running (the wait
        for one of `tool_threads` threads does not count); a call still queued, when no call has
        begun running for `tool_timeout_s` since it was queued (every thread is then held by a call
        past its timeout)."""
        if call.started is not None:
            return call.started + self.settings.tool_timeout_s
        return max(call.submitted, self._last_start) + self.settings.tool_timeout_s

    def _collect(self, ep: Episode) -> None:
        """Queue the turn's calls that may run now; when every call is answered (or past its
        deadline), append the tool turn. With `wait_for_tools` one episode's calls run one after
        another in the order written, so the tools' per-episode state (the calculator's last
        result) follows that order in every run; without it they run together."""
        now = time.monotonic()
        for call in ep.calls:
            if call.answer is not None:
                continue
            if call.future is None:
                call.submitted, call.future = now, self._pool.submit(call.run)
            if call.future.done():
                call.answer = call.future.result()
            elif now >= self._deadline(call):
                queued = call.future.cancel()  # True: it never began running
                text = (f"error: {call.name} did not start: every tool thread is held by a call past its timeout"
                        if queued else f"error: {call.name} timed out after {self.settings.tool_timeout_s:g} s")
                call.answer = ToolResult(text, error="timeout", timed_out=True, seconds=self.settings.tool_timeout_s)
            elif self.settings.wait_for_tools:
                break  # the calls after it are queued once it is answered
        if any(c.answer is None for c in ep.calls):
            return
        answers = [c.answer for c in ep.calls]
        ep.tool_calls += len(answers)
        ep.tool_errors += sum(a.error is not None for a in answers)
        ep.tool_timeouts += sum(a.timed_out for a in answers)
        ep.tool_seconds += sum(a.seconds for a in answers)
        ep.calls = []
        cap, side = self.settings.max_tool_response_chars, self.settings.tool_response_truncate_side
        ids = self.encoder.encode([encodable(cut_tool_output(a.text, cap, side)) for a in answers],
                                  ended_on=ep.response_ids[-1])  # the model's last token
        room = self.settings.max_response_length - len(ep.response_ids)
        ep.append(ids[:room], model=False)
        if len(ids) >= room:
            return self._done(ep, "length")
        ep.phase = Phase.GENERATING

    def _done(self, ep: Episode, reason: str) -> None:
        ep.phase, ep.finish_reason = Phase.DONE, reason

    def _finish(self, ep: Episode) -> None:
        """Tool rewards of the episode, then the tools' per-episode state is released."""
        ep.tool_reward = float(sum(
            tool.calc_reward(ep.episode_id, **ep.tools_kwargs.get(name, {}).get("calc_reward_kwargs", {}))
            for name, tool in self.tools.tools.items()))
        self._release(ep)

    def _release(self, ep: Episode) -> None:
        for name, tool in self.tools.tools.items():
            tool.release(ep.episode_id, **ep.tools_kwargs.get(name, {}).get("release_kwargs", {}))

