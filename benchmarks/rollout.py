"""Rollout throughput: the HF transformers engine against the vLLM engine, side by side.

A random Qwen2 (`--size tiny`: 4 layers, hidden 256, head_dim 64; `--size 25m`: the shape of
benchmarks/e2e_25m.py) generates a fixed number of tokens per sequence (EOS ignored), so both
engines do the same work. vLLM is measured only where it can be
imported (the CPU build lives in its own environment, see tools/vllm_env.sh). The HF engine runs on
`--device` (default: the GPU where torch sees one, else the CPU); the JSON records which.

`--engines hf,hf_concat_cache` also times the HF engine with transformers' own `DynamicCache`,
which concatenates each token's keys and values onto a copy of the whole cache, against the
engine's preallocated cache (`megarl.rollout.hf_engine.decoding_cache`); `hf_repeat_kv` times it
with transformers' sdpa attention, which under a padding mask repeats the key/value heads of each
group at every token, against the engine's grouped-query attention
(`megarl.rollout.hf_engine.grouped_sdpa_attention`); `hf_fused_decode_attention` times a decoded
token's attention through torch's fused CPU kernel against the engine's float32 matrix products
(`megarl.rollout.hf_engine.decode_attention`); `hf_cast_cache` keeps a bfloat16 model's KV cache
in bfloat16, which that attention casts to float32 at every token, and `hf_float32_cache` keeps it
in float32, against the engine's choice between the two by the cache's size on CPU
(`megarl.rollout.hf_engine.kv_storage_dtype`); `hf_plain_linear` runs the linear layers through
`F.linear` on their plain weights against the engine's oneDNN multiplies on weights reordered once
(`megarl.rollout.hf_engine.PackedLinear`; records before it named the candidate `hf_packed_linear`,
timed the other way round). The variants alternate
with the engine as it is call by call, on the same prompts and seeds; `--update-between-calls`
updates every weight before each call, as a training step does, so that what the engine redoes
after a weight change (re-packing) is timed, and `--pack-min-hidden-size 0` packs a model of any
size (`megarl.rollout.hf_engine.PACK_MIN_HIDDEN_SIZE`).

    python benchmarks/rollout.py [--out benchmarks/results/rollout.json]

Prints tokens/s per engine and the vLLM / HF ratio; writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import SIZES as E2E_SIZES  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "rollout.json"


# Model shapes: the default tiny Qwen2, and the ~25M one of benchmarks/e2e_25m.py (its context
# length left to max_position_embeddings below).
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2),
    "25m": {k: v for k, v in E2E_SIZES["25m"]["hf_config"].items() if k != "max_position_embeddings"},
}


def build_model(vocab_size: int, seed: int, size: str = "tiny") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab_size, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0,
        **MODEL_SIZES[size],
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def prompt_batch(num_prompts: int, vocab_size: int, seed: int) -> Any:
    from megarl.data.padding import left_pad
    from megarl.protocol import Batch

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 33, (num_prompts,), generator=generator).tolist()
    prompts = [torch.randint(1, vocab_size, (length,), generator=generator).tolist() for length in lengths]
    input_ids, attention_mask, _ = left_pad(prompts, pad_token_id=0)
    return Batch.from_dict({"input_ids": input_ids, "attention_mask": attention_mask})


def measure(engine: Any, prompts: Any, params: Any, repeats: int) -> dict[str, Any]:
    """Time ``repeats`` generate calls after one warm-up call."""
    engine.generate(prompts, params)
    seconds = []
    tokens = 0
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        seconds.append(time.perf_counter() - start)
        tokens = int(out["response_mask"].sum())
    # Best-of-k: on a shared machine the minimum is the least disturbed measurement.
    return {
        "generated_tokens_per_call": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / min(seconds),
        "tokens_per_s_median": tokens / statistics.median(seconds),
    }


def _concatenating_cache(engine: Any) -> Callable[[], None]:
    """Give the engine transformers' concatenating `DynamicCache`; returns the undo."""
    from megarl.rollout import hf_engine

    preallocated = hf_engine.decoding_cache
    hf_engine.decoding_cache = lambda config, capacity, storage_dtype=None: DynamicCache(config=config)

    def undo() -> None:
        hf_engine.decoding_cache = preallocated
    return undo


def _repeated_kv_heads(engine: Any) -> Callable[[], None]:
    """Put the engine's model back on transformers' sdpa attention (which repeats the key/value
    heads of a grouped-query model under a padding mask); returns the undo."""
    before = engine.model.config._attn_implementation
    engine.model.set_attn_implementation("sdpa")
    return lambda: engine.model.set_attn_implementation(before)


def _plain_linear(engine: Any) -> Callable[[], None]:
    """Run the engine's linear layers through `F.linear` on their plain weights (`nn.Linear`'s own
    forward) instead of oneDNN's on weights reordered once (`megarl.rollout.hf_engine.PackedLinear`);
    returns the undo."""
    from megarl.rollout.hf_engine import PackedLinear

    packed = [module for module in engine.model.modules() if type(module) is PackedLinear]
    for module in packed:
        module.__class__ = torch.nn.Linear

    def undo() -> None:
        for module in packed:
            module.__class__ = PackedLinear
    return undo


def _cast_cache(engine: Any) -> Callable[[], None]:
    """Keep the engine's KV cache in the model's dtype (before `kv_storage_dtype`); returns the undo."""
    from megarl.rollout import hf_engine

    float32_cache = hf_engine.kv_storage_dtype
    hf_engine.kv_storage_dtype = lambda device, model_dtype, layer_elements: None

    def undo() -> None:
        hf_engine.kv_storage_dtype = float32_cache
    return undo


def _float32_cache(engine: Any) -> Callable[[], None]:
    """Keep a bfloat16 or float16 model's KV cache in float32 on CPU whatever its size (the engine
    does above `FLOAT32_CACHE_ELEMENTS`); returns the undo."""
    from megarl.rollout import hf_engine

    by_size = hf_engine.FLOAT32_CACHE_ELEMENTS
    hf_engine.FLOAT32_CACHE_ELEMENTS = -1

    def undo() -> None:
        hf_engine.FLOAT32_CACHE_ELEMENTS = by_size
    return undo


def _fused_decode_attention(engine: Any) -> Callable[[], None]:
    """Route the engine's decoded-token attention to torch's fused kernel over a cache in the
    model's dtype (what `megarl.rollout.hf_engine.decode_attention` replaced); returns the undo."""
    from megarl.rollout import hf_engine

    undo_cache = _cast_cache(engine)
    hf_engine._decode_attention = hf_engine._fused_decode_attention

    def undo() -> None:
        hf_engine._decode_attention = hf_engine.decode_attention
        undo_cache()
    return undo


# Variants of the HF engine that `--engines` can name, each timed against the engine as it is: the
# function that sets the variant up (returning the undo), and the JSON key of the engine-as-is /
# variant throughput ratio (medians).
HF_VARIANTS: dict[str, tuple[Callable[[Any], Callable[[], None]], str]] = {
    "hf_concat_cache": (_concatenating_cache, "preallocated_over_concat_cache"),
    "hf_repeat_kv": (_repeated_kv_heads, "grouped_attention_over_repeat_kv"),
    "hf_fused_decode_attention": (_fused_decode_attention, "decode_attention_over_fused_kernel"),
    "hf_cast_cache": (_cast_cache, "engine_cache_over_cast_cache"),
    "hf_float32_cache": (_float32_cache, "engine_cache_over_float32_cache"),
    "hf_plain_linear": (_plain_linear, "packed_linear_over_plain_linear"),
}


def compare_variants(engine: Any, prompts: Any, params: Any, repeats: int, variants: list[str],
                     weights: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The HF engine as it is ("hf") and in each of `variants` (names of HF_VARIANTS), alternating
    call by call after one warm-up call each, on the same prompts and seeds. With `weights`, each
    call follows an update of every weight (untimed), as each step's generation follows a weight
    sync in training: what the engine redoes after a weight change is timed with the call."""
    seconds: dict[str, list[float]] = {name: [] for name in ["hf", *variants]}
    outputs = {}
    for call in range(repeats + 1):
        for name in seconds:
            undo = HF_VARIANTS[name][0](engine) if name in HF_VARIANTS else (lambda: None)
            try:
                if weights is not None:
                    engine.update_weights(weights.items())
                start = time.perf_counter()
                outputs[name] = engine.generate(prompts, dataclasses.replace(params, seed=call))
                if call:
                    seconds[name].append(time.perf_counter() - start)
            finally:
                undo()
    tokens = int(outputs["hf"]["response_mask"].sum())
    return {name: {"generated_tokens_per_call": tokens, "seconds": times, "tokens_per_s": tokens / min(times),
                   "tokens_per_s_median": tokens / statistics.median(times),
                   # the same seed, so the same samples unless the variant computed differently
                   "same_responses_as_hf": bool(torch.equal(outputs[name]["responses"], outputs["hf"]["responses"]))}
            for name, times in seconds.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from megarl.rollout import EngineOptions, SamplingParams
    from megarl.rollout import hf_engine as hf_engine_module
    from megarl.rollout.hf_engine import HFRolloutEngine
    from megarl.rollout.vllm_engine import vllm_import_error

    if args.pack_min_hidden_size is not None:
        hf_engine_module.PACK_MIN_HIDDEN_SIZE = args.pack_min_hidden_size
    model = build_model(args.vocab_size, args.seed, args.size)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    prompts = prompt_batch(args.num_prompts, args.vocab_size, args.seed)
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, ignore_eos=True)
    options = EngineOptions(
        pad_token_id=0, eos_token_ids=(), dtype=args.dtype, seed=args.seed,
        max_model_len=512, max_num_seqs=max(256, args.num_prompts * args.n), kv_cache_memory_gb=1.0,
    )
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    results: dict[str, Any] = {
        "config": {**vars(args), "out": str(args.out), "sequences": args.num_prompts * args.n,
                   "hf_device": str(device)},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()},
        "engines": {},
    }

    start = time.perf_counter()
    # On a GPU the engine gets a copy, so vLLM below starts from the same host weights.
    hf_engine = HFRolloutEngine(model if device.type == "cpu" else copy.deepcopy(model).to(device), options)
    startup = time.perf_counter() - start
    variants = [name for name in args.engines.split(",") if name in HF_VARIANTS]
    compared = (compare_variants(hf_engine, prompts, params, args.repeats, variants,
                                 state if args.update_between_calls else None) if variants else None)
    hf = measure(hf_engine, prompts, params, args.repeats) if compared is None else compared["hf"]
    start = time.perf_counter()
    hf_engine.update_weights(state.items())
    hf.update(startup_s=startup, update_weights_s=time.perf_counter() - start)
    results["engines"]["hf"] = hf
    for name in variants:  # the same engine: its start-up and weight update are hf's
        results["engines"][name] = {**compared[name], "startup_s": startup, "update_weights_s": hf["update_weights_s"]}
        results[HF_VARIANTS[name][1]] = hf["tokens_per_s_median"] / compared[name]["tokens_per_s_median"]
    hf_engine.release()

    error = vllm_import_error() if "vllm" in args.engines else "not requested"
    if error is None:
        from megarl.rollout.vllm_engine import VLLMRolloutEngine

        with tempfile.TemporaryDirectory() as model_dir:
            model.save_pretrained(model_dir)
            start = time.perf_counter()
            vllm_engine = VLLMRolloutEngine(model_dir, options)
            startup = time.perf_counter() - start
            vllm_result = measure(vllm_engine, prompts, params, args.repeats)
            start = time.perf_counter()
            vllm_engine.update_weights(state.items())
            vllm_result.update(startup_s=startup, update_weights_s=time.perf_counter() - start)
            # A per-call seed makes vLLM sample each sequence with its own generator.
            seeded = dataclasses.replace(params, seed=args.seed)
            vllm_seeded = {**measure(vllm_engine, prompts, seeded, args.repeats), "startup_s": startup,
                           "update_weights_s": vllm_result["update_weights_s"]}
            vllm_engine.release()
        results["engines"]["vllm"] = vllm_result
        results["engines"]["vllm_seeded"] = vllm_seeded
        results["vllm_over_hf"] = vllm_result["tokens_per_s"] / hf["tokens_per_s"]
    else:
        results["vllm_skipped"] = error
    return results


def report(results: dict[str, Any]) -> str:
    config = results["config"]
    lines = [
        f"rollout: {config['sequences']} sequences x {config['max_new_tokens']} new tokens, {config['dtype']}, "
        f"{config['size']} Qwen2 ({MODEL_SIZES[config['size']]}), {results['machine']['threads']} threads, "
        f"hf engine on {config.get('hf_device', 'cpu')}",
        f"{'engine':<12}{'tokens/s':>12}{'startup s':>12}{'update_weights s':>18}",
    ]
    for name, numbers in results["engines"].items():
        lines.append(
            f"{name:<12}{numbers['tokens_per_s']:>12.0f}{numbers['startup_s']:>12.2f}{numbers['update_weights_s']:>18.4f}"
        )
    for name, (_, key) in HF_VARIANTS.items():
        if key in results:
            lines.append(f"hf / {name} (medians): {results[key]:.2f}x")
    if "vllm_over_hf" in results:
        lines.append(f"vllm / hf throughput: {results['vllm_over_hf']:.2f}x")
    else:
        lines.append(f"vllm not measured: {results['vllm_skipped']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab-size", type=int, default=320)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--engines", default="hf,vllm", help=f"comma-separated: hf,vllm,{','.join(HF_VARIANTS)}")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="the HF engine's device (auto: cuda where torch sees a GPU, else cpu)")
    parser.add_argument("--pack-min-hidden-size", type=int, default=None,
                        help="the HF engine's PACK_MIN_HIDDEN_SIZE for this run (0: pack any model; default: the engine's)")
    parser.add_argument("--update-between-calls", action="store_true",
                        help="with HF variants: update every weight before each call, as a training step does")
    parser.add_argument("--seed", type=int, default=0, help="model, prompts and engine seed")
    parser.add_argument("--size", default="tiny", choices=sorted(MODEL_SIZES),
                        help="tiny: 4 layers, hidden 256; 25m: the shape of benchmarks/e2e_25m.py")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    print(report(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
