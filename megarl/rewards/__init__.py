"""Rewards: rule-based scorers, user reward functions in isolated workers, the reward manager.

- ``scorers``: gsm8k, math, countdown, arithmetic, chosen by ``data_source`` (standard library only).
- ``manager.RewardManager``: batches scoring, DAPO overlong shaping, token-level scores.
- ``pool.ScoringPool`` / ``worker``: isolated scoring processes with per-call timeouts.

Import submodules explicitly: worker processes import this package and must stay light.
"""
