"""User reward functions for the pool and manager tests, loaded by file path (never imported)."""

import os
import time

import numpy as np


def exact_match(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    correct = solution_str.strip() == str(ground_truth)
    return {
        "score": float(correct) + bonus,
        "acc": correct,
        "pid": os.getpid(),
        "note": "dropped: not numeric",
    }


def echo_extra_info(data_source, solution_str, ground_truth, extra_info=None):
    return float(extra_info["weight"]) if data_source == "weighted" else -1


def raises_on_bad(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "bad":
        raise RuntimeError("boom in user code")
    if solution_str == "exit":
        raise SystemExit(4)
    return 1.0


def hangs_on_hang(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        while True:  # a pure-Python busy loop: no signal-based timeout could interrupt C code either
            pass
    if solution_str == "sleep":
        time.sleep(3600)
    return 1.0


def crashes_on_crash(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "crash":
        os._exit(3)
    return 0.5


def garbage(data_source, solution_str, ground_truth, extra_info=None):
    return {
        "nan": float("nan"),
        "inf": float("inf"),
        "str": "1.0",
        "none": None,
        "list": [1.0],
        "nodict": {"acc": 1.0},
        "dictnan": {"score": float("nan")},
        "numpy": np.float32(0.25),
        "bool": True,
    }[solution_str]


def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.2)
    return {"score": 1.0, "pid": os.getpid()}


NOT_CALLABLE = 3


def torch_loaded(data_source, solution_str, ground_truth, extra_info=None):
    import sys

    return float("torch" in sys.modules)
