"""Tools for multi-turn rollouts: tool-call parsers, tools with OpenAI schemas, a process sandbox.

The per-request agent loop over the rollout engines is not built yet; these parts are used by it
and tested on their own (tests/unit/agent).
"""
