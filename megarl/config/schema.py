"""The typed schema of a megarl experiment.

Every key a YAML file or a command-line override may set is a field below. Names follow verl where a
verl user would look for them (``actor.optim.lr``, ``rollout.n``, ``algorithm.adv_estimator``,
``actor.clip_ratio_low`` ...). Batch sizes counted in *prompts* are named ``*_batch_size``; micro-batch
sizes are per data-parallel rank, counted in *sequences* (prompt + one response), as in verl.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ParallelConfig:
    """Megatron 4D (+EP) layout of one role. ``data_parallel_size`` is derived: world / (tp*pp*cp)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    # Megatron's expert tensor parallel size: how many ranks split each expert's weights (null: the
    # tensor_model_parallel_size). 1 with TP > 1 keeps experts whole and spreads them over more ranks.
    expert_tensor_parallel_size: Optional[int] = None
    # Megatron sequence parallelism: activations outside the TP regions split along the sequence over
    # the TP ranks (needs tensor_model_parallel_size > 1; required to train MoE models at TP > 1).
    sequence_parallel: bool = False
    # Set explicitly to assert the derived value; null derives it from the pool size.
    data_parallel_size: Optional[int] = None


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    clip_grad: float = 1.0
    # After linear warmup: constant | cosine (decay to min_lr) | linear (decay to min_lr)
    lr_scheduler: str = "constant"
    # The schedule counts trainer steps, as verl's does: warmup over lr_warmup_steps of them (0: the
    # ratio of total_training_steps), decay over total_training_steps (null: the run's,
    # trainer.total_training_steps or its epochs). The engine advances it at every optimizer step, by
    # ppo_epochs x (data.train_batch_size / ppo_mini_batch_size) optimizer steps a trainer step.
    lr_warmup_steps: int = 0
    lr_warmup_steps_ratio: float = 0.0
    # Read by a decaying schedule and by a warmup ratio; set beside a constant schedule without one: refused.
    total_training_steps: Optional[int] = None
    # Megatron's distributed optimizer: the Adam state is split over the DP ranks (gradients
    # reduce-scattered, parameters all-gathered after the step). false: every DP rank keeps all of
    # it and the gradients are all-reduced (less traffic, more memory; faster for small CPU runs).
    use_distributed_optimizer: bool = True


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    tokenizer: Optional[str] = None  # null: the model's directory
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 8  # prompts per step
    # Prompts generated per round of DAPO dynamic sampling (algorithm.filter_groups); rounds repeat
    # until train_batch_size groups carry a signal. null: train_batch_size.
    gen_batch_size: Optional[int] = None
    val_batch_size: Optional[int] = None  # null: the whole validation set in one batch
    # A prompt over max_prompt_length: error | left | right | middle (cut there). Applies to the
    # prompts that filter_overlong_prompts keeps: with it on (the default) none is over the limit.
    truncation: str = "error"
    filter_overlong_prompts: bool = True  # drop prompts over max_prompt_length when the data is opened
    # A row that fails its checks (prompt, one the chat template refuses, data_source, ground truth,
    # text that is not UTF-8; with multi-turn tools its extra_info.tools_kwargs) is skipped, counted
    # and logged when the dataset is opened, instead of stopping the run.
    skip_bad_rows: bool = False
    apply_chat_template: str = "auto"  # auto | true | false
    # Extra arguments of the tokenizer's chat template, as verl's data.apply_chat_template_kwargs
    # (e.g. {enable_thinking: false} for Qwen3); used where the chat template is applied.
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    shuffle: bool = True
    seed: int = 1


@dataclass
class ModelConfig:
    # A HF model directory (config.json, weights optional) ...
    path: Optional[str] = None
    # ... or a HF config given inline (random init), e.g. for tiny CPU models. With model.path it may
    # only repeat config.json's values (so layouts validate before the weights are at hand), unless
    # model.init_from_scratch, where it sets keys over config.json's for the model built.
    hf_config: dict[str, Any] = field(default_factory=dict)
    # Architecture family in model_specs/ (e.g. qwen2, llama); null detects it from config.json's
    # model_type. Set it for a checkpoint whose model_type no family lists but whose layout one has.
    spec: Optional[str] = None
    dtype: str = "fp32"  # fp32 | bf16 (training and, unless rollout.dtype, rollout)
    init_from_scratch: bool = False  # ignore weights in `path`, initialise randomly with `seed`
    # Activation recompute in the training roles: activations are recomputed in the backward pass
    # instead of kept (less memory, ~1/3 more compute with "full").
    enable_gradient_checkpointing: bool = False
    recompute_granularity: str = "full"  # full (whole layers) | selective (core attention only)
    # Rows of a micro-batch concatenated without padding (verl's use_remove_padding), every role.
    # Off by default: on CPU (local spec: one dense block-diagonal mask over the packed row) it is not
    # faster at every size. benchmarks/packing.py, 64 rows of 1..64 response tokens, micro-batches of
    # 16 rows, median speedup of log-prob / update over padding, two runs on a loaded 2-core machine:
    # quickstart size 1.08 / 1.04 and 0.91 / 0.73; 25M Qwen2 1.35 / 1.33 and 1.27 / 1.24. With
    # use_dynamic_bsz it was slower than dynamic padded micro-batches at both sizes in both runs.
    use_remove_padding: bool = False
    # Rows of a micro-batch that share a prompt (the n responses of a group) become one sequence:
    # the prompt, then each response seeing only the prompt and itself, so the prompt's tokens are
    # computed once (megarl/megatron/shared_prompts.py). Training, log-prob and value passes; not a
    # reward model's. auto: where it costs fewer multiply-adds than the micro-batch as it is (the
    # attention becomes a dense masked product over the longer sequence, so long responses keep the
    # padded layout); always: whenever two rows share a prompt; never. Needs the local layer spec
    # (not TransformerEngine), no context, pipeline or sequence parallelism: elsewhere auto is never,
    # and on a GPU too (measured slower there; benchmarks/HISTORY.md).
    prompt_sharing: str = "auto"
    # HF config keys set over model.path's config.json (or model.hf_config), e.g. rope_theta; the run
    # builds its model directory from the result, which the actor, the reference, the rollout and a
    # critic without its own critic.model_path load. A critic.model_path or a reward model is loaded
    # with its own config.json as it is.
    override_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"  # vanilla | gspo | cispo | gpg | reinforce


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: ParallelConfig = field(default_factory=ParallelConfig)
    ppo_mini_batch_size: int = 8  # prompts per optimizer step (x rollout.n sequences)
    # Sequences per forward/backward on one DP rank (not with use_dynamic_bsz, which forms the
    # micro-batches by ppo_max_token_len_per_gpu tokens instead)
    ppo_micro_batch_size_per_gpu: int = 4
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # null: clip_ratio
    clip_ratio_high: Optional[float] = None  # null: clip_ratio
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    loss_agg_mode: str = "token-mean"
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    # Sequences per forward-only pass (old log-probs) on one DP rank; null: ppo_micro_batch_size_per_gpu.
    # With use_dynamic_bsz the passes take ppo_max_token_len_per_gpu tokens instead.
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    # Move to host memory while the actor is not computing (onloaded for log-probs and the update).
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    # Where the PPO ratio's old log-probs come from (metric training/old_log_prob_source: 0/1/2):
    #   recompute (0): a forward pass of the actor before the update (phase old_log_prob);
    #   update (1): the update's own log-probs, detached (ratio exactly 1: the vanilla policy
    #     gradient), no pass. Only when the policy cannot change between generation and the update:
    #     ppo_epochs 1 and ppo_mini_batch_size = data.train_batch_size; not with
    #     algorithm.use_kl_in_reward, which needs them before the update;
    #   rollout (2): the rollout engine's log-probs (rollout.calculate_log_probs), no pass (verl's
    #     bypass mode); the KL in the reward then uses them too;
    #   auto: update where it is allowed, else recompute.
    # Without the pass, the rollout-vs-trainer gap (training/rollout_logprob_abs_diff_*,
    # rollout.max_logprob_gap, rollout_corr/*) is measured on the update's first optimizer step's
    # log-probs, after the update; actor/entropy always comes from the update.
    old_log_prob_source: str = "auto"
    # Rows whose advantage is zero on every response token (e.g. a GRPO group whose responses all
    # scored the same) are left out of the update's forward and backward passes where that leaves
    # the gradient unchanged: a built-in policy loss (vanilla, gspo, cispo, reinforce/gpg, each
    # proportional to the advantage), entropy_coeff 0 and no KL loss; elsewhere it does nothing. The
    # rows still count in the loss's normalisers, so each optimizer step is the one the full batch
    # gives. Metrics actor/zero_advantage_rows_skipped and actor/zero_advantage_tokens_skipped: the
    # shares of the rows and of their tokens (prompt + response) left out. The update's
    # metrics (actor/entropy, actor/pg_clipfrac, actor/ppo_kl) are then over the rows it ran, and
    # so is the rollout-vs-trainer gap. Where the old-log-prob pass runs (old_log_prob_source
    # recompute) without a reference or critic, the advantages come before it and it computes only
    # the rows the update runs (training/old_log_prob_rows_skipped: the share left out; their
    # old_log_probs are NaN); the scores are then needed before it and do not overlap it
    # (reward.overlap). When no pass of the actor, reference or critic comes before the
    # advantages, trainer.balance_batch balances the rows' tokens the update runs
    # (global_seqlen/*), after them.
    skip_zero_advantage_rows: bool = True


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # null: on when the advantage estimator needs values (gae)
    # A HF directory to start the critic from (e.g. a reward model: its `score` head becomes the value
    # head); null: the actor's model (trunk) with a fresh value head.
    model_path: Optional[str] = None
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    megatron: Optional[ParallelConfig] = None  # null: the actor's layout
    ppo_mini_batch_size: int = 8
    ppo_micro_batch_size_per_gpu: int = 4
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    ppo_epochs: int = 1
    shuffle: bool = False
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    # Move to host memory while the critic is not computing (gradients go with the parameters).
    param_offload: bool = False
    optimizer_offload: bool = False


@dataclass
class RefConfig:
    enable: Optional[bool] = None  # null: on when a KL term (loss or reward) needs it
    megatron: Optional[ParallelConfig] = None  # null: the actor's layout
    # sequences per micro-batch of the reference's pass; with actor.use_dynamic_bsz the pass splits by
    # actor.ppo_max_token_len_per_gpu tokens instead, as the actor's own passes
    log_prob_micro_batch_size_per_gpu: int = 8
    param_offload: bool = False  # host memory except while computing reference log-probs


@dataclass
class RewardModelConfig:
    # A Megatron reward model scores each response (its value head at the last valid token); the
    # score goes to the last response token, with or instead of the rule scorers (see `combine`).
    enable: bool = False
    # A HF sequence-classification directory with one label (e.g. Qwen2ForSequenceClassification,
    # its `score` head) and, when its vocabulary differs from the actor's, its own tokenizer.
    model_path: Optional[str] = None
    megatron: Optional[ParallelConfig] = None  # null: the actor's layout
    micro_batch_size_per_gpu: int = 8  # sequences per forward pass on one DP rank
    param_offload: bool = False  # host memory except while scoring
    # How a row's score is made, per row by its dataset column `reward_model.style` ("rule" where a
    # row has none; under by_style, training data without any "model" row is refused: the reward
    # model would score rows and count for none):
    #   by_style: style "rule" -> the rule scorer's score, style "model" -> the reward model's
    #     (reward.overlong_buffer shapes the rule scorer's score only)
    #   weighted_sum: rule_weight * rule score (rows of style "rule") + model_weight * model score (all rows)
    combine: str = "by_style"
    rule_weight: float = 1.0
    model_weight: float = 1.0


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    name: str = "compute_score"


@dataclass
class RewardConfig:
    # Built-in scorers are chosen per sample by `data_source`; a custom function overrides them.
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    # The worker pool that runs a custom reward function (num_workers processes, 0: one per core;
    # each call under timeout_s; the batch_timeout_s and worker_memory_mb below). Built-in scorers run
    # in the driver and use none of these four keys.
    num_workers: int = 2
    timeout_s: float = 10.0  # per scoring call
    # The longest one batch's scoring may take in the worker pool; calls still unanswered then are
    # cancelled and count as timeouts (so max_failure_share decides). null: no deadline.
    batch_timeout_s: Optional[float] = 120.0
    # Resident-memory limit of each scoring worker (MiB); a worker over it is replaced and its call
    # counts as a crash. 0: no limit.
    worker_memory_mb: int = 4096
    # Stop the run when more than this share of one batch's scoring calls failed (error, bad_return,
    # timeout, crash), naming the function and quoting the first failure. Every scored batch counts,
    # validation batches included (so with val_before_train a broken function stops the run before
    # the first update). 1.0: never stop, failed calls score 0.
    max_failure_share: float = 0.5
    # Score on the driver while the workers run the step's first forward pass (old log-probs,
    # reference or values), instead of before it. Applies without the DAPO group filter and the
    # reward model, and when such a pass runs before the advantages (not the old-log-prob pass
    # alone under actor.skip_zero_advantage_rows, which needs the advantages first);
    # `training/reward_overlapped` says whether it did.
    overlap: bool = True
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class ValidationSamplingConfig:
    n: int = 1
    do_sample: bool = False  # false: greedy, which reads none of the keys below (set with it: refused)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tool calls (megarl.agent): the model's turns alternate with tool outputs."""

    # The keys below are read only with enable; set without it: refused.
    enable: bool = False
    # Tools by name: built-ins (calculator, code_interpreter) or "package.module:ClassName" (a megarl.agent.tools.Tool)
    tools: list[str] = field(default_factory=list)
    max_turns: int = 4  # assistant turns per episode; rollout.response_length caps model + tool tokens over all turns
    tool_timeout_s: float = 10.0  # per tool call, from when it begins running; past it the model reads a timeout error
    # tool calls of one assistant turn that run, as verl's key; unlike verl, which drops them,
    # each later call of the turn is answered with an error saying it was not run (answers pair by position)
    max_parallel_calls: int = 8
    max_tool_response_chars: int = 256  # a longer tool output is cut before it is tokenised, marked "(truncated)"
    tool_response_truncate_side: str = "middle"  # what of a cut output is kept: left (its start) | middle | right (its end)
    format: str = "hermes"  # tool-call format of the model's turns (megarl.agent.parsers)
    # true: each round of generation waits for every running tool call and one episode's calls of a
    # turn run in the order written, so rounds, sampled tokens and tool state do not depend on tool
    # timing and a seeded run is reproducible; false: a turn's calls run together and requests whose
    # tools answered go on meanwhile (faster when some tools are slow, not reproducible)
    wait_for_tools: bool = True


@dataclass
class RolloutConfig:
    engine: str = "auto"  # auto | vllm | hf
    n: int = 4  # responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    response_length: Optional[int] = None  # null: data.max_response_length
    # Every response (training and validation) runs to the full length: EOS and stop tokens do not
    # end it (verl's rollout.ignore_eos; benchmarks comparing at equal lengths).
    ignore_eos: bool = False
    tensor_model_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5  # vLLM on a GPU: its share of device memory (weights + KV cache)
    kv_cache_memory_gb: float = 1.0  # vLLM's CPU build: its KV cache size (the HF engine sizes its own per call)
    max_num_seqs: int = 256  # vLLM: sequences in one batch of its scheduler (the HF engine decodes each call whole)
    # The engine sleeps (KV cache and weight copy released) from the end of generation to the next
    # weight sync; the HF engine on CPU releases its weight copy at sleep_level 2 (its cache lives
    # only during a generate call).
    free_cache_engine: bool = True
    # What sleeping releases: 2 = KV cache and the weights (the next sync rewrites them; the driver
    # syncs again after a sleep), 1 = KV cache only, the weights kept (in host memory on GPU).
    sleep_level: int = 2
    enforce_eager: bool = True  # vLLM: no CUDA graphs (the HF engine has none)
    dtype: Optional[str] = None  # null: model.dtype
    # Keep the log-probs of the sampled tokens (rollout_log_probs, and the rollout-vs-trainer gap metric)
    calculate_log_probs: bool = True
    # processed: log_softmax(logits / temperature) after top-k/top-p (verl's default); raw: log_softmax(logits)
    logprobs_mode: str = "processed"
    val_kwargs: ValidationSamplingConfig = field(default_factory=ValidationSamplingConfig)
    # Largest weight-sync bucket (one sender to one receiver). A rank posts its buckets in rounds of at
    # most this much sent and as much received, two rounds in flight: at most 4x this of staging memory.
    update_weights_bucket_mb: int = 512
    # Check every k-th weight sync (the first included) against the senders' fingerprints of each
    # bucket; a changed bucket stops the run naming tensor, slice and ranks. 0: never. Only buckets
    # that cross processes are checked: a sync inside the actor's processes that moves nothing
    # between them (data parallelism only, rollout TP 1) has nothing to check.
    sync_verify_freq: int = 1
    # Stop the run when a step's mean |rollout log-prob - trainer log-prob| over the response tokens
    # (training/rollout_logprob_abs_diff_mean, nats) exceeds this: the rollout engine is not sampling
    # from the trained policy (weights not synced, precision mismatch). Measured on CPU (quickstart):
    # 1.4e-7 with fp32 on both sides, 2e-3 with a bf16 rollout of the fp32 weights; 0.93 after five
    # optimizer steps not synced to the rollout (tiny model, lr 1e-3). Not yet measured on GPU bf16
    # engines: look at the metric of a first run there. null: never. Needs calculate_log_probs. Not
    # checked (metrics only) under top_p < 1 / top_k > 0 with logprobs_mode processed, or raw at a
    # temperature other than 1: the rollout's log-probs are then not the trainer's quantity (a value
    # other than the default there, or without calculate_log_probs, with probe_freq 0, where nothing
    # compares it: refused).
    max_logprob_gap: Optional[float] = 0.1
    # End-to-end check of the weight sync on a fixed probe batch: after a sync of the weights of
    # version v (actor updates so far) with v a multiple of probe_freq (the initial weights included),
    # the rollout engine samples one response to each of the first `probe_prompts` training prompts
    # (the training sampling, one fixed seed) and the actor scores the same tokens with the weights it
    # just sent: probe/logprob_abs_diff_mean above max_logprob_gap stops the run. It runs whatever
    # calculate_log_probs and trainer.async_mode (whose older-weights batches the per-step check above
    # leaves out), single-turn; it costs one short generation and one actor forward pass. 0: never.
    probe_freq: int = 0
    probe_prompts: int = 8  # set with probe_freq 0: refused
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    enable: bool = False  # DAPO dynamic sampling
    # acc | score | seq_reward (sum of scores) | seq_final_reward (sum of rewards: dynamic sampling
    # runs before any KL penalty, so it equals seq_reward; refused with algorithm.use_kl_in_reward) |
    # any reward-info key
    metric: str = "acc"
    max_num_gen_batches: int = 10  # <= 0: no cap


@dataclass
class RolloutCorrectionConfig:
    # Correct the policy loss for the rollout engine's log-probs differing from the trainer's:
    # w = exp(trainer log-prob - rollout log-prob) per token (needs rollout.calculate_log_probs). The
    # trainer log-prob is the old log-prob (actor.old_log_prob_source recompute or update); with
    # source rollout there is none, and it is the current micro-batch's own, detached: after the
    # first optimizer step of a step w then also holds how far the policy has moved.
    #   none: no correction (the rollout_corr/* mismatch metrics are still logged)
    #   tis: truncated IS, each token's loss x min(w, threshold)
    #   mis: masked IS, x w where lower <= w <= upper, else 0 (the token or sequence is dropped)
    #   icepop: IcePop, x w where lower <= w <= upper, else 0, per token (mis at level token)
    #   reject: the tokens or sequences mis drops are dropped, the others unweighted (with
    #     actor.old_log_prob_source rollout the PPO ratio already carries w: the masking mode for it)
    # Dropped tokens keep their place in the loss normaliser.
    mode: str = "none"
    # w per token (token), or on every token of a response the product (sequence) or the geometric
    # mean (geometric) of its tokens' w
    level: str = "token"
    threshold: float = 2.0  # tis: the cut
    lower: float = 0.5  # mis, icepop, reject: the band of kept weights
    upper: float = 2.0


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    pass_k: Optional[int] = None  # grpo_passk: k of pass@k; null = rollout.n
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # Your modules registering advantage estimators, policy losses or KL estimators
    # (megarl.algorithms.register_*): dotted module names importable on every node, or .py paths.
    # The driver imports them before the config is checked, every actor worker before it builds its
    # loss; the names they register are then valid values of the keys above and of actor.*.
    import_modules: list[str] = field(default_factory=list)


@dataclass
class TrainerConfig:
    project_name: str = "megarl"
    experiment_name: str = "default"
    total_epochs: int = 1  # read only when total_training_steps is null (setting both is refused)
    # null: the run ends with the data of total_epochs epochs (with DAPO dynamic sampling a step may
    # take several batches, so it can end before epochs x batches per epoch steps)
    total_training_steps: Optional[int] = None
    test_freq: int = -1  # validate every k steps; <= 0: only at the end
    save_freq: int = -1  # checkpoint every k steps and after the last step; <= 0: never
    val_before_train: bool = True
    val_only: bool = False  # validate (the initial or resumed weights) and stop
    # Reorder each step's rows so every actor DP rank gets about the same real tokens (metrics
    # global_seqlen/*); the rows keep their uid, the dumps keep the rollout order. With more than one
    # mini-batch per epoch the mini-batches hold other rows than without it.
    balance_batch: bool = True
    # async_mode sync with the hybrid engine: the next step's weight sync and generation are sent to
    # the workers right behind the actor update, so they run while the driver finishes the step
    # (metrics, logging, the next batch); the same prompts, seeds and weights as one call after the
    # other, and timing_s/gen is then the wait for it (the sync shows in sync/seconds_max). Not with
    # an offloaded actor, nor before a checkpoint, profiled or probed step.
    queue_generation: bool = True
    # Write each step's generations, scores and advantages as <dir>/<step>.jsonl; null: off
    rollout_data_dir: Optional[str] = None
    # Write validation generations as <dir>/<step>.jsonl; null: off
    validation_data_dir: Optional[str] = None
    # Steps to profile with the torch profiler on every worker: Chrome traces under
    # <run dir>/profile/step_<k>/<role>_rank<r>.json
    profile_steps: list[int] = field(default_factory=list)
    critic_warmup: int = 0  # steps that train only the critic
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: Optional[str] = None  # resume_mode resume_path: the global_step_N dir to resume
    # When the checkpoint to resume from fails verification: resume from the newest earlier one that
    # passes (true) or stop, naming the damaged file and that earlier checkpoint (false)
    resume_fallback: bool = False
    max_ckpt_to_keep: Optional[int] = 2  # checkpoints kept, those saved last (>= 1); null: every one
    default_local_dir: str = "runs/${trainer.project_name}/${trainer.experiment_name}"
    seed: int = 1
    # sync: every batch is generated with the weights it is trained from. one_step_off: the next
    # batch is generated (by a separate rollout pool, resources.rollout_pool) while this one trains,
    # so every batch is one weight version old (with algorithm.rollout_correction to weight it);
    # the pipeline is drained before each checkpoint, so a resume continues the same run.
    # bounded_staleness: as one_step_off, but the weights go to the rollout pool only when a row
    # would otherwise be more than max_staleness versions older than the weights it trains with.
    async_mode: str = "sync"
    max_staleness: int = 1  # bounded_staleness: the bound, >= 1
    # Partial rollout (one_step_off / bounded_staleness): the next step's generation runs in chunks
    # of partial_rollout_chunk_tokens and stops between two of them once the update has made newer
    # weights; after the weight sync its unfinished rows go on from their tokens (continue) or are
    # sampled again from their prompts (drop). Every token records its weight version. off: each
    # row is generated whole with one version. partial_rollout_interrupt_after: k stops the
    # generation after k chunks whatever the timing (reproducible); null: when the update is done.
    partial_rollout: str = "off"  # off | continue | drop
    partial_rollout_chunk_tokens: int = 16
    partial_rollout_interrupt_after: Optional[int] = None
    progress_bar: bool = True


@dataclass
class PoolConfig:
    nnodes: int = 1
    devices_per_node: int = 1


@dataclass
class ResourcesConfig:
    device: str = "auto"  # auto | cpu | cuda
    ray_address: Optional[str] = None  # null: start a local Ray cluster for the run
    # A local cluster's CPUs (null: what the run's pools need) and object store; a cluster at
    # ray_address keeps its own settings.
    ray_num_cpus: Optional[int] = None
    object_store_memory_gb: float = 2.0
    num_cpus_per_worker: float = 1.0
    # CPU training with plain DDP (use_distributed_optimizer false): how the data-parallel ranks sum
    # their gradients. shared_memory: through one shared-memory segment when every rank of the group
    # runs on one host (else gloo, with a warning when it cannot be set up); gloo: gloo's all-reduce.
    cpu_grad_reduce: str = "shared_memory"
    # The pool the actor (with rollout and, by default, the reference) runs in.
    actor_pool: PoolConfig = field(default_factory=PoolConfig)
    # Separate pools: null shares the actor pool (colocated).
    critic_pool: Optional[PoolConfig] = None
    ref_pool: Optional[PoolConfig] = None
    reward_model_pool: Optional[PoolConfig] = None
    # null: the rollout engines share the actor's processes (the hybrid engine). Set: they run in a
    # pool of their own, as many ranks as the actor's pool, fed over a bridge between the pools;
    # needed by trainer.async_mode one_step_off.
    rollout_pool: Optional[PoolConfig] = None


@dataclass
class TrackingConfig:
    backends: list[str] = field(default_factory=lambda: ["console", "jsonl", "mlflow"])
    # null: sqlite store under the run directory; set without mlflow in backends: refused
    mlflow_tracking_uri: Optional[str] = None
    report_plots: bool = True


@dataclass
class ExperimentConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
