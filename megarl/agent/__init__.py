"""Multi-turn rollouts with tools: the agent loop, tool-call parsers, tools with OpenAI schemas, a
process sandbox.

`loop.AgentLoop` runs each request as its own state machine over a rollout engine's token-level
`generate_tokens` (turns batched across requests, tools in a thread pool); `rollout.multi_turn_generate`
turns its episodes into the trainer's rollout batch (tool-output tokens off the response mask);
`RolloutRole.generate` uses it when `rollout.multi_turn.enable` is set.
"""
