"""The files a run reads are checked before anything starts, by `megarl config validate` and by
`megarl train` alike (`check_run_files`): data, tokenizer, reward function, the model's architecture
and its safetensors weights (headers and byte ranges, no tensor read). Every problem at once, each
naming its key and path."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from omegaconf import OmegaConf
from safetensors.torch import save_file

from megarl.cli import main as cli_main
from megarl.config import load_config
from megarl.config.model_files import safetensors_problem, weights_problems
from megarl.config.run_files import check_run_files, reward_function_problem, run_file_problems
from megarl.data.parquet_io import write_parquet
from megarl.data.tokenizer import build_char_tokenizer, load_tokenizer
from megarl.errors import ConfigError
from megarl.rewards.worker import load_user_function
from megarl.trainer.setup import prepare_run

pytestmark = pytest.mark.unit

HF = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def save_model(path: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**HF))
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_task(root: Path) -> dict[str, str]:
    """A train parquet, a tokenizer and a model directory; the paths as config values."""
    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": f"{i}+1="}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(8)]
    write_parquet(rows, root / "train.parquet")
    build_char_tokenizer("0123456789+=", root / "tok")
    save_model(root / "model")
    return {"train": str(root / "train.parquet"), "tokenizer": str(root / "tok"), "model": str(root / "model")}


def experiment(tmp_path: Path, paths: dict[str, str]) -> Path:
    exp = {
        "data": {"train_files": [paths["train"]], "tokenizer": paths["tokenizer"], "train_batch_size": 4,
                 "max_prompt_length": 16, "max_response_length": 8, "apply_chat_template": "false"},
        "model": {"path": paths["model"]},
        "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2,
                  "megatron": {"tensor_model_parallel_size": 2}},
        "rollout": {"n": 2},
        "trainer": {"default_local_dir": str(tmp_path / "run")},
        "resources": {"actor_pool": {"nnodes": 1, "devices_per_node": 2}},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


@pytest.fixture
def task(tmp_path: Path) -> dict[str, str]:
    return write_task(tmp_path)


def test_a_complete_run_passes(tmp_path: Path, task: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert run_file_problems(load_config(experiment(tmp_path, task))) == []
    assert cli_main(["config", "validate", str(experiment(tmp_path, task))]) == 0
    assert "exp.yaml: valid" in capsys.readouterr().out


def test_missing_data_tokenizer_and_reward_function_all_at_once(tmp_path: Path, task: dict[str, str],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "not_parquet.parquet").write_text("a,b\n1,2\n")
    fn = tmp_path / "reward.py"
    fn.write_text("def other(**kwargs):\n    return 0.0\n")
    args = ["config", "validate", str(experiment(tmp_path, task)),
            f"data.train_files=[{tmp_path / 'gone.parquet'},{tmp_path / 'not_parquet.parquet'}]",
            f"data.val_files=[{tmp_path}]", f"data.tokenizer={tmp_path / 'no_tok'}",
            f"reward.custom_reward_function.path={fn}", "reward.custom_reward_function.name=compute_score"]
    assert cli_main(args) == 1
    err = capsys.readouterr().err
    assert f"data.train_files[0] = '{tmp_path / 'gone.parquet'}': no such file" in err
    assert f"data.train_files[1] = '{tmp_path / 'not_parquet.parquet'}': not a parquet file (8 bytes" in err
    assert f"data.val_files[0] = '{tmp_path}': not a file" in err
    assert f"data.tokenizer = '{tmp_path / 'no_tok'}': no such directory" in err
    assert f"reward.custom_reward_function.name = 'compute_score': {fn} defines no such top-level function " \
           "(functions there: ['other'])" in err
    # `--schema-only` checks the config alone.
    assert cli_main([*args[:2], "--schema-only", *args[2:]]) == 0


def test_reward_function_file_missing_or_not_python(tmp_path: Path, task: dict[str, str]) -> None:
    cfg = load_config(experiment(tmp_path, task), [f"reward.custom_reward_function.path={tmp_path / 'nope.py'}"])
    assert run_file_problems(cfg) == [f"reward.custom_reward_function.path = '{tmp_path / 'nope.py'}': no such file"]
    bad = tmp_path / "bad.py"
    bad.write_text("def compute_score(:\n")
    cfg = load_config(experiment(tmp_path, task), [f"reward.custom_reward_function.path={bad}"])
    assert "not valid Python" in run_file_problems(cfg)[0]
    good = tmp_path / "good.py"
    good.write_text("from math import tanh as compute_score\n")  # an imported name counts as defined
    cfg = load_config(experiment(tmp_path, task), [f"reward.custom_reward_function.path={good}"])
    assert run_file_problems(cfg) == []


# Files the scoring worker loads with `compute_score` bound: each must pass the check.
BOUND_AT_MODULE_LEVEL = {
    "inside_try": "try:\n    import json\n\n    def compute_score(**kw):\n        return 1.0\n"
                  "except ImportError:\n    compute_score = None\n",
    "inside_if": "import sys\nif sys.version_info >= (3, 8):\n    def compute_score(**kw):\n        return 1.0\n"
                 "else:\n    def compute_score(**kw):\n        return 0.0\n",
    "inside_with": "import contextlib\nwith contextlib.suppress(Exception):\n    from math import tanh as compute_score\n",
    "star_import": "from helper_scores import *\n",
    "tuple_assignment": "def _a(**kw):\n    return 1.0\n\ncompute_score, other = _a, _a\n",
    "starred_assignment": "def _a(**kw):\n    return 1.0\n\n*_, compute_score = [_a, _a]\n",
    "for_target": "def _a(**kw):\n    return 1.0\n\nfor compute_score in [_a]:\n    pass\n",
    "walrus": "def _a(**kw):\n    return 1.0\n\nif (compute_score := _a):\n    pass\n",
    "module_getattr": "def __getattr__(name):\n    return lambda **kw: 1.0\n",
}


@pytest.mark.parametrize("case", sorted(BOUND_AT_MODULE_LEVEL))
def test_reward_function_bound_anywhere_at_module_level_passes(tmp_path: Path, case: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader puts the file's directory first
    (tmp_path / "helper_scores.py").write_text("def compute_score(**kw):\n    return 1.0\n")
    fn = tmp_path / f"{case}.py"
    fn.write_text(BOUND_AT_MODULE_LEVEL[case])
    assert reward_function_problem(str(fn), "compute_score") is None
    # The scoring worker loads it too: the check refuses nothing that would run.
    assert callable(load_user_function(str(fn), "compute_score"))


@pytest.mark.parametrize("source, functions", [
    ("def other(**kw):\n    return 0.0\n", ["other"]),
    # Bound only inside a function, a class, a comprehension, or annotated without a value: not the module's.
    ("def outer():\n    def compute_score(**kw):\n        return 1.0\n", ["outer"]),
    ("class Scorer:\n    compute_score = staticmethod(abs)\n", []),
    ("fns = [compute_score for compute_score in (abs,)]\n", []),
    ("compute_score: int\n", []),
    ("try:\n    def helper(**kw):\n        return 1.0\nexcept ImportError:\n    pass\n", ["helper"]),
])
def test_reward_function_bound_nowhere_is_refused(tmp_path: Path, source: str, functions: list[str]) -> None:
    fn = tmp_path / "reward.py"
    fn.write_text(source)
    assert reward_function_problem(str(fn), "compute_score") == (
        f"reward.custom_reward_function.name = 'compute_score': {fn} defines no such top-level function "
        f"(functions there: {functions})")
    bad = tmp_path / "bad.py"
    bad.write_text("try:\n    def compute_score(:\n")
    assert "not valid Python" in reward_function_problem(str(bad), "compute_score")


def test_unsupported_model_type_found_before_a_model_is_built(tmp_path: Path, task: dict[str, str]) -> None:
    config_file = Path(task["model"]) / "config.json"
    config = json.loads(config_file.read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    config_file.write_text(json.dumps(config))
    for overrides in ([], ["model.init_from_scratch=true"]):
        problems = run_file_problems(load_config(experiment(tmp_path, task), overrides))
        assert len(problems) == 1, problems
        assert problems[0].startswith(f"model.path: {config_file}: model_type = 'gpt2' (architectures "
                                      "['GPT2LMHeadModel']) is not supported; supported families: ")
        assert "qwen2 (qwen2)" in problems[0]
    # Inline config (no model.path): named as model.hf_config.
    cfg = load_config(experiment(tmp_path, task), ["model.path=null", "model.hf_config={model_type: bert}"])
    assert run_file_problems(cfg)[0].startswith("model.hf_config: model_type = 'bert'")
    # model.spec names the family: the config's model_type is not consulted.
    assert run_file_problems(load_config(experiment(tmp_path, task), ["model.spec=qwen2"])) == []


def test_override_config_is_checked_over_the_checkpoint_before_workers_start(tmp_path: Path,
                                                                            task: dict[str, str]) -> None:
    """The workers build the model from the checkpoint's config.json seen through model.override_config:
    a setting the spec refuses there (a RoPE type it does not compute) is found before they start."""
    config_file = Path(task["model"]) / "config.json"
    yarn = '+model.override_config.rope_parameters={rope_type: yarn, factor: 4.0, rope_theta: 10000.0}'
    problems = run_file_problems(load_config(experiment(tmp_path, task), [yarn]))
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"model.override_config over model.path: {config_file}: ")
    assert "rope_parameters.rope_type = 'yarn' is not supported; valid: ['default', 'llama3']" in problems[0]
    # A setting the spec maps passes.
    assert run_file_problems(load_config(experiment(tmp_path, task), ["+model.override_config.rope_theta=20000.0"])) == []


def test_missing_and_unreadable_weights(tmp_path: Path, task: dict[str, str]) -> None:
    model = Path(task["model"])
    (model / "model.safetensors").rename(tmp_path / "moved.safetensors")
    cfg = load_config(experiment(tmp_path, task))
    assert run_file_problems(cfg) == [
        f"model.path = '{model}': no weights (model.safetensors or model.safetensors.index.json); set "
        "model.init_from_scratch: true to start from random weights, or point to a saved model"]
    assert run_file_problems(load_config(experiment(tmp_path, task), ["model.init_from_scratch=true"])) == []
    (model / "pytorch_model.bin").write_bytes(b"\0" * 16)
    assert "megarl reads safetensors weights only (found ['pytorch_model.bin']" in run_file_problems(cfg)[0]


def test_truncated_safetensors_names_the_file_and_tensor(tmp_path: Path, task: dict[str, str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    weights = Path(task["model"]) / "model.safetensors"
    data = weights.read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + header_len])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    weights.write_bytes(data[:-100])
    data_len = len(data) - 100 - 8 - header_len
    problems = run_file_problems(load_config(experiment(tmp_path, task)))
    assert problems == [f"model.path: {weights}: truncated: tensor '{last}' ends at data byte "
                        f"{header[last]['data_offsets'][1]}, the file holds {data_len} data bytes "
                        f"({len(data) - 100} bytes in all)"]
    assert cli_main(["config", "validate", str(experiment(tmp_path, task))]) == 1
    assert str(weights) in capsys.readouterr().err
    weights.write_bytes(data[:5])
    assert "no header length" in safetensors_problem(weights)


def test_safetensors_byte_ranges_hand_made(tmp_path: Path) -> None:
    """A header whose range does not match shape x dtype size is corrupt even when the file is long enough."""
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, str(good))
    assert safetensors_problem(good) is None

    def write(header: dict, data_bytes: int) -> Path:
        raw = json.dumps(header).encode()
        path = tmp_path / "hand.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)
        return path

    # 2x3 F32 = 24 bytes, so [0, 20) is wrong.
    path = write({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, 24)
    assert "tensor 'a' of shape [2, 3] F32 needs 24 bytes, its range is [0, 20)" in safetensors_problem(path)
    path = write({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
                  "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]}}, 31)
    assert "truncated: tensor 'b' ends at data byte 32, the file holds 31 data bytes" in safetensors_problem(path)
    path = write({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}, 1)
    assert "corrupt safetensors header (tensor 'a'" in safetensors_problem(path)


def test_sharded_index_naming_a_missing_shard(tmp_path: Path) -> None:
    model = tmp_path / "sharded"
    model.mkdir()
    save_file({"a": torch.zeros(2)}, str(model / "model-00001-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weights_problems(model, "critic.model_path") == [
        f"critic.model_path: {model / 'model.safetensors.index.json'} names shard file(s) "
        "['model-00002-of-00002.safetensors'] that are missing (1 of 2 present)"]


def test_critic_model_path_is_checked(tmp_path: Path, task: dict[str, str]) -> None:
    cfg = load_config(experiment(tmp_path, task), ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=4",
                                                   "critic.ppo_micro_batch_size_per_gpu=2",
                                                   f"critic.model_path={tmp_path / 'x'}"])
    assert run_file_problems(cfg) == [f"critic.model_path = '{tmp_path / 'x'}': no such directory"]


def critic_from(tmp_path: Path, task: dict[str, str], critic_dir: Path) -> list[str]:
    """The file problems of a PPO run whose critic starts from `critic_dir`."""
    cfg = load_config(experiment(tmp_path, task), ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=4",
                                                   "critic.ppo_micro_batch_size_per_gpu=2",
                                                   f"critic.model_path={critic_dir}"])
    return run_file_problems(cfg)


def test_critic_checkpoint_must_read_the_actors_token_ids(tmp_path: Path, task: dict[str, str],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The critic values the batch's token ids as the actor's tokenizer made them (a reward model of
    another vocabulary gets the text re-tokenised, the critic cannot): a critic checkpoint with a
    tokenizer of other ids (a reward model fitted on it), or an embedding smaller than the actor's
    tokenizer, is refused before any worker starts, naming the file."""
    actor = load_tokenizer(task["tokenizer"])
    assert len(actor) == 16  # 4 special tokens, then the 12 characters
    # Without a tokenizer of its own, or with the actor's, the critic reads the actor's ids: it passes.
    critic = save_model(tmp_path / "critic")
    assert critic_from(tmp_path, task, critic) == []
    build_char_tokenizer("0123456789+=", critic)
    assert critic_from(tmp_path, task, critic) == []
    # The digits permuted and 4 tokens more: "0" is another id there.
    permuted = save_model(tmp_path / "permuted")
    build_char_tokenizer("9876543210+=abcd", permuted)
    assert load_tokenizer(permuted).convert_tokens_to_ids("0") != actor.convert_tokens_to_ids("0")
    problems = critic_from(tmp_path, task, permuted)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"critic.model_path = '{permuted}': its tokenizer ({permuted / 'tokenizer.json'}) "
                                  f"maps tokens to other ids than the actor's ({task['tokenizer']}); the critic "
                                  "reads the actor's token ids (unlike the reward model, whose input is "
                                  "re-tokenised with its own tokenizer)"), problems[0]
    # `megarl config validate` refuses it too.
    assert cli_main(["config", "validate", str(experiment(tmp_path, task)), "algorithm.adv_estimator=gae",
                     "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2",
                     f"critic.model_path={permuted}"]) == 1
    assert f"critic.model_path = '{permuted}': its tokenizer" in capsys.readouterr().err
    # No tokenizer of its own, but an embedding of 8 ids: the actor's ids 8..15 fall past it.
    small = tmp_path / "small"
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**HF, "vocab_size": 8})).save_pretrained(
        small, safe_serialization=True)
    assert critic_from(tmp_path, task, small) == [
        f"critic.model_path: {small / 'config.json'}: vocab_size = 8, but the actor's tokenizer ({task['tokenizer']}) "
        "has 16 token ids; the critic reads the actor's token ids (unlike the reward model, whose input is "
        "re-tokenised with its own tokenizer), so its embedding must cover every one"]


def test_train_runs_the_same_checks_before_writing_anything(tmp_path: Path, task: dict[str, str]) -> None:
    cfg = load_config(experiment(tmp_path, task), [f"data.train_files=[{tmp_path / 'gone.parquet'}]"])
    with pytest.raises(ConfigError) as info:
        prepare_run(cfg)
    with pytest.raises(ConfigError) as same:
        check_run_files(cfg)
    assert str(info.value) == str(same.value) and "data.train_files[0]" in str(info.value)
    assert not (tmp_path / "run").exists()
    assert OmegaConf.select(cfg, "trainer.default_local_dir") == str(tmp_path / "run")


def test_multi_turn_tools_are_imported_before_workers_start(tmp_path: Path, task: dict[str, str]) -> None:
    """A tool given as "package.module:ClassName" is imported by the check, as the rollout workers will:
    a missing module, a missing class or a class that is no Tool is named by its place in the list."""
    tools = "[calculator, nosuch.module:Calc, megarl.agent.tools:NoSuchTool, megarl.agent.tools:ToolResult]"
    cfg = load_config(experiment(tmp_path, task), ["rollout.multi_turn.enable=true", f"rollout.multi_turn.tools={tools}"])
    problems = run_file_problems(cfg)
    assert len(problems) == 3, problems
    assert problems[0].startswith("rollout.multi_turn.tools[1]: tool 'nosuch.module:Calc': cannot import it")
    assert problems[1].startswith("rollout.multi_turn.tools[2]: tool 'megarl.agent.tools:NoSuchTool': cannot import")
    assert problems[2] == ("rollout.multi_turn.tools[3]: tool 'megarl.agent.tools:ToolResult' is not a subclass of "
                           "megarl.agent.tools.Tool")
    ok = load_config(experiment(tmp_path, task), ["rollout.multi_turn.enable=true",
                                                   "rollout.multi_turn.tools=[calculator, megarl.agent.tools:PythonTool]"])
    assert run_file_problems(ok) == []
