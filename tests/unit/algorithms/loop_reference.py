"""Independent float64 references for the algorithm tests, written plainly: Python lists and loops.

They restate each formula from its definition (often in a different but equivalent form than the
library, e.g. explicit sums instead of recursions) and share no code with megarl.algorithms.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict

Matrix = list[list[float]]


def whiten_valid(x: Matrix, mask: Matrix) -> Matrix:
    """(x - mean) / sqrt(unbiased var + 1e-8) over valid entries; 0 elsewhere."""
    vals = [x[i][t] for i in range(len(x)) for t in range(len(x[i])) if mask[i][t]]
    mean = sum(vals) / len(vals) if vals else 0.0
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1) if len(vals) > 1 else 0.0
    return [
        [(x[i][t] - mean) / math.sqrt(var + 1e-8) if mask[i][t] else 0.0 for t in range(len(x[i]))]
        for i in range(len(x))
    ]


def gae(rewards: Matrix, values: Matrix, mask: Matrix, gamma: float, lam: float) -> tuple[Matrix, Matrix]:
    """GAE over each response's valid tokens only (masked tokens are skipped entirely).

    For valid positions p_0 < p_1 < ... of a row: delta_j = r[p_j] + gamma * v[p_{j+1}] - v[p_j]
    (v after the last valid token is 0) and A_j = sum_{l >= j} (gamma * lam)^(l - j) * delta_l.
    """
    adv = [[0.0] * len(row) for row in rewards]
    ret = [[0.0] * len(row) for row in rewards]
    for i in range(len(rewards)):
        pos = [t for t in range(len(rewards[i])) if mask[i][t]]
        deltas = []
        for j, p in enumerate(pos):
            next_v = values[i][pos[j + 1]] if j + 1 < len(pos) else 0.0
            deltas.append(rewards[i][p] + gamma * next_v - values[i][p])
        for j, p in enumerate(pos):
            a = sum((gamma * lam) ** (l - j) * deltas[l] for l in range(j, len(pos)))
            adv[i][p] = a
            ret[i][p] = a + values[i][p]
    return whiten_valid(adv, mask), ret


def reinforce_pp(rewards: Matrix, mask: Matrix, gamma: float) -> tuple[Matrix, Matrix]:
    """G_t = sum over the valid tokens k >= t of gamma^j r_k, j the number of valid tokens strictly
    between t and k: masked tokens (observations) are skipped, not counted as steps."""
    ret = [[0.0] * len(row) for row in rewards]
    for i in range(len(rewards)):
        valid = [t for t in range(len(rewards[i])) if mask[i][t]]
        for n, t in enumerate(valid):
            ret[i][t] = sum(gamma ** j * rewards[i][k] for j, k in enumerate(valid[n:]))
    return whiten_valid(ret, mask), ret


def remax(rewards: Matrix, mask: Matrix, baselines: list[float]) -> tuple[Matrix, Matrix]:
    ret = [[0.0] * len(row) for row in rewards]
    adv = [[0.0] * len(row) for row in rewards]
    for i in range(len(rewards)):
        for t in range(len(rewards[i])):
            if mask[i][t]:
                ret[i][t] = sum(rewards[i][k] for k in range(t, len(rewards[i])) if mask[i][k])
                adv[i][t] = ret[i][t] - baselines[i]
    return adv, ret


def _groups(group_ids: list[int]) -> dict[int, list[int]]:
    members: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    return members


def _broadcast(per_sample: list[float], mask: Matrix) -> Matrix:
    return [[per_sample[i] if m else 0.0 for m in mask[i]] for i in range(len(mask))]


def grpo(rewards: Matrix, mask: Matrix, group_ids: list[int], norm_by_std: bool, eps: float = 1e-6) -> Matrix:
    scores = [sum(row) for row in rewards]
    out = [0.0] * len(scores)
    for members in _groups(group_ids).values():
        group_scores = [scores[i] for i in members]
        if len(members) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = statistics.fmean(group_scores), statistics.stdev(group_scores)
        for i in members:
            out[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return _broadcast(out, mask)


def rloo(rewards: Matrix, mask: Matrix, group_ids: list[int]) -> Matrix:
    """s_i minus the mean of the *other* responses of the group (baseline 0 when there are none)."""
    scores = [sum(row) for row in rewards]
    out = [0.0] * len(scores)
    for members in _groups(group_ids).values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            out[i] = scores[i] - (sum(others) / len(others) if others else 0.0)
    return _broadcast(out, mask)


def reinforce_pp_baseline(rewards: Matrix, mask: Matrix, group_ids: list[int]) -> Matrix:
    scores = [sum(row) for row in rewards]
    out = [0.0] * len(scores)
    for members in _groups(group_ids).values():
        mean = statistics.fmean(scores[i] for i in members) if len(members) > 1 else 0.0
        for i in members:
            out[i] = scores[i] - mean
    return whiten_valid(_broadcast(out, mask), mask)


def grpo_passk(
    rewards: Matrix, mask: Matrix, group_ids: list[int], k: int | None, norm_by_std: bool, eps: float = 1e-6
) -> Matrix:
    """Brute force: mean over all k-subsets S containing i of max(S) - max(S without i)."""
    scores = [sum(row) for row in rewards]
    out = [0.0] * len(scores)
    for members in _groups(group_ids).values():
        kk = len(members) if k is None else k
        std = statistics.stdev([scores[i] for i in members])
        for i in members:
            others = [j for j in members if j != i]
            credits = [
                max(scores[i], *(scores[j] for j in rest)) - max(scores[j] for j in rest)
                for rest in itertools.combinations(others, kk - 1)
            ]
            a = sum(credits) / len(credits)
            out[i] = a / (std + eps) if norm_by_std else a
    return _broadcast(out, mask)


# ----------------------------------------------------------------------------------------------
# Losses


def agg_weights(mask: Matrix, mode: str, max_len: int | None = None) -> Matrix:
    """d(aggregated loss)/d(loss_mat[i][t]) for the whole batch, from the mode's definition."""
    n_tokens = sum(1 for row in mask for m in row if m)
    lengths = [sum(1 for m in row if m) for row in mask]
    n_seqs = sum(1 for n in lengths if n > 0)
    big_l = max_len if max_len is not None else len(mask[0])
    weights = []
    for i, row in enumerate(mask):
        w_row = []
        for m in row:
            if not m:
                w_row.append(0.0)
            elif mode == "token-mean":
                w_row.append(1.0 / n_tokens)
            elif mode == "seq-mean-token-sum":
                w_row.append(1.0 / n_seqs)
            elif mode == "seq-mean-token-mean":
                w_row.append(1.0 / (n_seqs * lengths[i]))
            elif mode == "seq-mean-token-sum-norm":
                w_row.append(1.0 / (n_seqs * big_l))
            else:
                raise ValueError(mode)
        weights.append(w_row)
    return weights


def aggregate(loss: Matrix, mask: Matrix, mode: str, max_len: int | None = None) -> float:
    w = agg_weights(mask, mode, max_len)
    return sum(w[i][t] * loss[i][t] for i in range(len(loss)) for t in range(len(loss[i])) if mask[i][t])


def ppo_token(log_ratio: float, adv: float, low: float, high: float, c: float) -> tuple[float, float, bool, bool]:
    """Vanilla PPO per token: (loss, d loss / d log_prob, clipped?, dual-clipped?)."""
    clamped = max(-20.0, min(20.0, log_ratio))
    ratio = math.exp(clamped)
    d_ratio = ratio if clamped == log_ratio else 0.0  # d ratio / d log_prob
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - low), 1 + high)
    if clipped > unclipped:  # ratio outside [1-low, 1+high] on the side that would help: no gradient
        loss, grad, was_clipped = clipped, 0.0, True
    else:
        loss, grad, was_clipped = unclipped, -adv * d_ratio, False
    dual = False
    if adv < 0 and -adv * c < loss:
        loss, grad, dual = -adv * c, 0.0, True
    return loss, grad, was_clipped, dual


def value_loss_token(vpred: float, ret: float, old: float, clip: float) -> tuple[float, float, bool]:
    """0.5 * max((v - R)^2, (clip(v) - R)^2) before aggregation: (term, d term / d vpred, clipped?)."""
    clipped_v = min(max(vpred, old - clip), old + clip)
    a, b = (vpred - ret) ** 2, (clipped_v - ret) ** 2
    if b > a:
        grad = 2 * (clipped_v - ret) if old - clip < vpred < old + clip else 0.0
        return b, grad, True
    return a, 2 * (vpred - ret), False


def entropy(logits: list[float]) -> float:
    top = max(logits)
    weights = [math.exp(z - top) for z in logits]
    total = sum(weights)
    return -sum((w / total) * math.log(w / total) for w in weights if w > 0)
