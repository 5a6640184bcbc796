"""`megarl sync plan` against a hand count: a 1-layer Qwen2 (hidden 8, intermediate 16, 2 heads,
vocabulary 32) trained at TP=2 and synced into the HF engine (rollout TP=1) on 2 ranks.

HF tensors, in elements: embedding 32x8 = 256, q/k/v 3 x (8x8 + 8 bias) = 216, o 64, gate/up/down
3 x 128 = 384, two layer norms 16, final norm 8, lm_head 32x8 = 256: 1,200 in all. The 24 norm
elements are on both training ranks; the attention and feed-forward tensors (664) are split in
halves. Megatron pads the vocabulary to a multiple of 128 x TP = 256 rows, so TP rank 0 holds rows
0-127 of the embedding and the output layer (all 32 real rows) and rank 1 only padding. Rank 0 thus
holds 512 + 332 + 24 = 868 elements and receives 332 (1,328 bytes in fp32); rank 1 holds 356 and
receives 844 (3,376 bytes). Each sends what the other lacks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.cli import main
from megarl.errors import ConfigError
from megarl.hybrid.plan_cli import parse_layout

pytestmark = pytest.mark.unit

TINY = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 32,
        "max_position_embeddings": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
RANK0_IN, RANK1_IN = 332 * 4, 844 * 4


@pytest.fixture()
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def plan_json(capsys: pytest.CaptureFixture, config: Path, *extra: str) -> dict:
    assert main(["sync", "plan", str(config), "--train", "tp=2", "--rollout-tp", "1", "--dtype", "fp32",
                 "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_bytes_match_the_hand_count(capsys: pytest.CaptureFixture, config: Path) -> None:
    out = plan_json(capsys, config, "--gpus-per-node", "2")
    assert out["world_size"] == 2 and out["engine"] == "hf"
    assert out["bytes_received"] == out["bytes_minimum"] == RANK0_IN + RANK1_IN == 4704
    assert [(r["received"], r["sent"]) for r in out["ranks"].values()] == [(RANK0_IN, RANK1_IN), (RANK1_IN, RANK0_IN)]
    assert out["largest_rank_received"] == out["largest_rank_sent"] == RANK1_IN
    assert out["bytes_inter_node"] == 0  # both ranks on one node


def test_cross_node_traffic_and_predicted_time(capsys: pytest.CaptureFixture, config: Path) -> None:
    out = plan_json(capsys, config, "--gpus-per-node", "1", "--intra-gbps", "100", "--inter-gbps", "1")
    assert out["bytes_inter_node"] == RANK0_IN + RANK1_IN  # one rank per node: everything crosses
    # Full duplex at 1 GB/s: each rank needs max(in, out) = 3,376 bytes' time.
    assert out["predicted_seconds"] == pytest.approx(RANK1_IN / 1e9)
    assert out["ranks"]["0"]["received_inter_node"] == out["ranks"]["1"]["sent_inter_node"] == RANK0_IN
    within = plan_json(capsys, config, "--gpus-per-node", "2", "--intra-gbps", "2", "--inter-gbps", "1")
    assert within["predicted_seconds"] == pytest.approx(RANK1_IN / 2e9)


def test_text_output(capsys: pytest.CaptureFixture, config: Path) -> None:
    assert main(["sync", "plan", str(config), "--train", "tp=2", "--rollout-tp", "1", "--per-rank"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("sync tp=2 -> hf rollout tp=1 (2 ranks, bfloat16, 8 GPUs per node)")
    assert "predicted time" in text and len([line for line in text.splitlines() if line.startswith("     ")]) == 2


@pytest.mark.parametrize("args, message", [
    (["--train", "tp=2,xp=2", "--rollout-tp", "1"], "'xp=2' is not <degree>=<integer >= 1>"),
    (["--train", "tp=0", "--rollout-tp", "1"], "'tp=0' is not"),
    (["--train", "tp=2", "--rollout-tp", "3"], "--rollout-tp 3 must be >= 1 and divide the world size 2"),
    (["--train", "tp=2", "--rollout-tp", "2", "--engine", "hf"], "--engine hf holds whole tensors"),
    (["--train", "tp=2,ep=2", "--rollout-tp", "1"], "ep=2 must divide dp*cp=1"),
    (["--train", "dp=2,ep=2", "--rollout-tp", "1"], "ep=2 needs a mixture-of-experts model"),
    (["--train", "tp=2", "--rollout-tp", "1", "--bucket-mib", "0"], "--bucket-mib 0: must be > 0"),
])
def test_bad_layouts_are_named(capsys: pytest.CaptureFixture, config: Path, args: list[str], message: str) -> None:
    assert main(["sync", "plan", str(config), *args]) == 1
    assert message in capsys.readouterr().err


def test_parse_layout_defaults_to_one() -> None:
    assert parse_layout("tp=8,pp=4") == {"tp": 8, "pp": 4, "dp": 1, "cp": 1, "ep": 1, "etp": 0}  # etp 0: = tp
    assert parse_layout("tp=2,dp=4,ep=8,etp=1")["etp"] == 1
    with pytest.raises(ConfigError, match="degree from tp, pp, dp, cp, ep, etp"):
        parse_layout("tp8")


def test_a_closed_pipe_ends_the_command_quietly(config: Path) -> None:
    """`megarl sync plan --json | head -1`: the reader goes away before the output is written (here a
    reader that exits at once, long before Python has imported megarl); the command exits 141
    (128 + SIGPIPE) without a traceback."""
    import subprocess
    import sys

    code = ("import sys; from megarl.cli import main; sys.exit(main(['sync', 'plan', sys.argv[1], '--train', "
            "'tp=2', '--rollout-tp', '1', '--dtype', 'fp32', '--json', '--per-rank']))")
    done = subprocess.run(f"{sys.executable} -c \"{code}\" {config} | true; "
                          "echo status ${PIPESTATUS[0]} >&2", shell=True, executable="/bin/bash",
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert "status 141" in done.stderr, done.stderr
