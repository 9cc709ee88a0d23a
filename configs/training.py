"""The trainer's config section (pydantic): placement, precision, parallelism, the loss, the
optimizer and LoRA. Re-exported by :mod:`configs.schema`; imports no torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from configs.base import Section


class LossConfig(Section):
    """The policy loss and its options (trainer/losses/; field for field the same as its LossSpec).

    Ratios: pi_rollout sampled the token, pi_train is the trainer now, pi_old the trainer at the
    start of the step. "mismatch ratio" = pi_train / pi_rollout.
    """

    type: Literal["aipo", "ppo_clip", "importance_sampling", "gspo"] = Field(
        "aipo",
        description="aipo: masked importance-weighted policy gradient -sg(r*A)*log pi (prime-rl); ppo_clip: "
        "max(-A*r, -A*clip(r, 1-eps_clip, 1+eps_clip_high)); importance_sampling: -(r*A), no clip; gspo: "
        "sequence-level geometric-mean ratio with clipping (arXiv:2507.18071).",
    )
    adv_tau: float = Field(1.0, ge=0, allow_inf_nan=False, description="Weight of the advantage (every type).")
    ratio_type: Literal["token", "sequence"] = Field(
        "token",
        description=(
            "aipo only: weight each token by its own ratio, or by its sample's product of ratios clipped at "
            "sequence_clip_high."
        ),
    )
    token_mask_low: float = Field(
        0.125,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="aipo only: loss tokens with mismatch ratio below this get zero gradient.",
    )
    token_mask_high: float = Field(
        8.0,
        ge=1,
        allow_inf_nan=False,
        description="aipo only: loss tokens with mismatch ratio above this get zero gradient.",
    )
    geo_mask_low: float = Field(
        0.1,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="aipo only: samples whose geometric-mean mismatch ratio is below this get zero gradient.",
    )
    geo_mask_high: float = Field(
        10.0,
        ge=1,
        allow_inf_nan=False,
        description="aipo only: samples whose geometric-mean mismatch ratio is above this get zero gradient.",
    )
    sequence_mask_low: float | None = Field(
        None,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="aipo only, null = off: samples with any loss token's mismatch ratio below this get zero gradient.",
    )
    sequence_mask_high: float | None = Field(
        None,
        ge=1,
        allow_inf_nan=False,
        description="aipo only, null = off: samples with any loss token's mismatch ratio above this get zero gradient.",
    )
    sequence_clip_high: float = Field(
        10.0, ge=1, allow_inf_nan=False, description="aipo with ratio_type sequence: upper clip of the sample's ratio."
    )
    eps_clip: float = Field(
        0.2,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="ppo_clip and gspo: lower clip 1 - eps_clip of the ratio (GSPO paper: 3e-4).",
    )
    eps_clip_high: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description=(
            "ppo_clip and gspo: upper clip 1 + eps_clip_high (DAPO clip-higher: 0.28; GSPO paper: 4e-4); null = "
            "eps_clip."
        ),
    )
    eps_clip_c: float | None = Field(
        None,
        gt=1,
        allow_inf_nan=False,
        description=(
            "ppo_clip only, null = off: dual clip, a negative-advantage token's loss is at most -A * eps_clip_c (verl "
            "default 3)."
        ),
    )
    icepop_beta: float | None = Field(
        None,
        gt=1,
        allow_inf_nan=False,
        description=(
            "Any type, null = off: IcePop, loss tokens whose mismatch ratio is outside [1/beta, beta] get zero "
            "gradient."
        ),
    )
    use_tis: bool = Field(
        False,
        description="Any type: truncated importance sampling; the ratio becomes pi_train/pi_old and each token's loss "
        "is weighted "
        "by clip(pi_old/pi_rollout, tis_clip_low, tis_clip_high).",
    )
    tis_clip_low: float = Field(0.0, ge=0, le=1, allow_inf_nan=False, description="Lower bound of the TIS weight.")
    tis_clip_high: float = Field(
        2.0, ge=1, allow_inf_nan=False, description="Upper bound of the TIS weight (the TIS blog's C = 2)."
    )
    kl_tau: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Any type: weight of the per-token KL(pi_train || reference) penalty; 0 = off.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description=(
            "KL penalty estimator (Schulman): k1 = log(pi/ref), k2 = log(pi/ref)^2 / 2, k3 = ref/pi - 1 - log(ref/pi)."
        ),
    )
    kl_reference: Literal["rollout", "reference"] = Field(
        "rollout",
        description=(
            "KL penalty against the sampler's logprobs, or a frozen reference model's (samples must carry them)."
        ),
    )
    teacher_tau: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description=(
            "Any type: on-policy distillation, advantage += teacher_tau * (teacher_logprobs - train_logprobs); needs "
            "teacher logprobs."
        ),
    )
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="token_mean: over every loss token of the step; seq_mean_token_mean: mean over samples of each "
        "sample's "
        "token mean; seq_mean_token_sum_norm: sum over tokens / sampling.max_tokens, mean over samples (Dr. GRPO).",
    )

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "LossConfig":
        if not self.tis_clip_low < self.tis_clip_high:
            raise ValueError(f"need tis_clip_low < tis_clip_high, got {self.tis_clip_low} and {self.tis_clip_high}")
        if self.type != "aipo":
            aipo_only = [k for k in ("sequence_mask_low", "sequence_mask_high") if getattr(self, k) is not None]
            aipo_only += ["ratio_type"] if self.ratio_type != "token" else []
            if aipo_only:
                raise ValueError(
                    f"{', '.join(aipo_only)} only apply to type aipo (type is {self.type}): remove them or set type: "
                    f"aipo"
                )
        if self.type != "ppo_clip" and self.eps_clip_c is not None:
            raise ValueError(f"eps_clip_c (dual clip) only applies to type ppo_clip (type is {self.type}): remove it")
        return self


class LoraSection(Section):
    """LoRA adapter (peft); disabled means full fine-tuning."""

    enabled: bool = Field(False, description="Train a LoRA adapter instead of all weights.")
    rank: int = Field(8, ge=1, le=1024, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (scale alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Module names that get adapters.",
    )


class OptimConfig(Section):
    """AdamW and its learning-rate schedule (trainer/optim/lr_schedule.py)."""

    lr: float = Field(
        1e-4, gt=0, le=1.0, description="Peak learning rate (the schedule multiplies it by a factor in [0, 1])."
    )
    scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="Learning-rate schedule over trainer.max_steps, after warmup_steps of linear warm-up: constant "
        "(lr), linear "
        "or cosine decay from lr to min_lr_ratio * lr at the last step (transformers' cosine-with-min-lr schedule). A "
        "checkpoint "
        "saves its step; a resumed run trains on with this config's lr and schedule from that step; every step record "
        "of metrics.jsonl has the step's `lr`.",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description=(
            "Steps of linear warm-up: step s < warmup_steps trains with lr * (s + 1) / warmup_steps (no zero-LR step). "
            "0: none."
        ),
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="linear and cosine: the learning rate at the last step, as a fraction of lr.",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient-norm clip.")


class TrainerConfig(Section):
    """The trainer."""

    max_steps: int = Field(60, ge=1, description="Optimizer steps of the run.")
    batch_size: int = Field(64, ge=1, description="Samples per optimizer step (a multiple of producers.group_size).")
    seed: int = Field(0, description="torch seed.")
    num_threads: int = Field(
        0,
        ge=0,
        le=1024,
        description=(
            "torch CPU threads of the trainer; 0 keeps torch's default. On a small CPU host leave cores to vLLM."
        ),
    )
    idle_threads: int = Field(
        0,
        ge=0,
        le=1024,
        description="torch CPU threads while the producers have nothing to sample (every step they may sample ahead, "
        "max_async_level, is already buffered): take the cores vLLM leaves idle on a shared CPU host "
        "(trainer/parallel/threads.py). "
        "0: always num_threads.",
    )
    checkpoint_interval: int = Field(
        10,
        ge=0,
        description="Save a resumable checkpoint (weights or adapter, optimizer, RNG, step, policy version) every this "
        "many optimizer "
        "steps and after the last one. The trainer releases a step's micro-batches and announces its groups as trained "
        "only once a "
        "checkpoint covers it, so the packer holds up to this many steps of micro-batches (one more while a checkpoint "
        "is written in the background). 0: no periodic checkpoints; steps are "
        "released right after training and a restarted trainer cannot resume (it refuses to start).",
    )
    checkpoint_keep: int = Field(
        2, ge=1, le=1000, description="Complete checkpoints kept on disk; older ones are deleted after each save."
    )
    data_parallel: int = Field(
        1,
        ge=1,
        le=1024,
        description="Data-parallel trainer ranks on this host. > 1: busctl launches the trainer under torchrun "
        "(`torch.distributed.run --standalone --nproc-per-node N`) as one supervised component; rank 0 talks to the "
        "bus "
        "and sends every other rank its share of each step's micro-batches; gradients are summed over ranks (DDP).",
    )
    dp_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description=(
            "torch.distributed backend of the data-parallel gradients; auto: nccl with CUDA (rank r on cuda:r), else "
            "gloo."
        ),
    )
    dp_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="Bound on each collective of the data-parallel group, seconds; ranks > 0 wait up to this long for "
        "rank 0's next step (which waits for the bus), so keep it above the slowest step.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where the trainer ranks run: cuda (one GPU per rank, trainer.gpus), cpu, or auto (cuda when "
        "busctl sees a "
        "CUDA device, else cpu). cuda on a host without CUDA is a config error at `busctl up`.",
    )
    gpus: list[int] = Field(
        default_factory=list,
        description="CUDA device indices (as nvidia-smi numbers them, before any CUDA_VISIBLE_DEVICES of busctl's own "
        "environment is applied) of the trainer ranks, one per rank (data_parallel of them). Empty: busctl gives the "
        "trainer "
        "the first data_parallel visible devices and the producers the next ones.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Compute dtype of the trainer's forward and backward. bfloat16: matmuls in bfloat16 with float32 "
        "master "
        "weights and AdamW state (torchtitan's mixed-precision policy); logprobs and the loss are always float32.",
    )
    lm_head_dtype: Literal["float32", "tf32", "bfloat16"] = Field(
        "tf32",
        description="Precision of the LM head's matmuls (the logits behind every logprob and importance ratio); the "
        "log-softmax and the loss are float32 in every case. tf32 (default): TF32 tensor-core matmuls on CUDA (inputs "
        "rounded to 10 mantissa bits, float32 accumulation and logits), on CPU exactly float32: on an H200 the 0.5B "
        "trainer step is 1.7x faster than with float32 at a logprob error far below a bfloat16 sampler's own rounding "
        "(bench/README.md). float32: the logprobs closest to the sampler's (MiniMax-M1's fix for the "
        "training/inference "
        "mismatch, arXiv:2506.13585). bfloat16: operands in bfloat16, fastest, ~8 mantissa bits in each logit.",
    )
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="How data_parallel > 1 ranks share the model: ddp (every rank holds the whole model and optimizer) "
        "or "
        "fsdp (torch FSDP2 fully_shard: parameters, gradients and AdamW state sharded over the ranks; checkpoints "
        "sharded "
        "with torch.distributed.checkpoint). With data_parallel 1 the trainer runs without torch.distributed and this "
        "key has no "
        "effect (bfloat16 then comes from trainer.dtype's autocast alone). LoRA trains with ddp only.",
    )
    share_prefixes: bool | Literal["auto"] = Field(
        "auto",
        description="Run the tokens that neighbouring packed samples share at their start (a group's prompt) through "
        "the "
        "decoder once and copy their hidden states to every sample (trainer/forward/shared_prefix.py, Prefix Grouper): "
        "the same "
        "logprobs and gradients up to float rounding. true / false: always / never. auto (default): always on a CPU "
        "(measured 1.5-2.9x faster per step there), and on CUDA for micro-batches of at least 12288 tokens only (an "
        "H200 "
        "0.5B GRPO-shaped step: 7% faster with 16384-token micro-batches, 17% slower with 8192: small micro-batches "
        "are "
        "launch-bound there and the gathers add launches; bench/README.md).",
    )
    activation_checkpointing: bool = Field(
        False,
        description=(
            "Recompute each decoder layer's activations in the backward instead of keeping them (less memory, ~1/3 "
            "more compute)."
        ),
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer (dynamic shapes, the packed attention left out; torchtitan's "
        "per-block "
        "compile; trainer/forward/compiled.py): fused element-wise kernels, at a one-off compile cost at the first "
        "step. "
        "Off by default until measured on a GPU (bench/gpu_session.sh).",
    )
    compile_backend: Literal["inductor", "aot_eager", "eager"] = Field(
        "inductor",
        description=(
            "The torch.compile backend of trainer.compile: inductor (generated fused kernels), aot_eager / eager "
            "(trace only: checks, no speed-up)."
        ),
    )
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    lora: LoraSection = Field(default_factory=LoraSection)

    @model_validator(mode="after")
    def _placement(self) -> "TrainerConfig":
        if self.optim.warmup_steps > self.max_steps:
            raise ValueError(
                f"trainer.optim.warmup_steps ({self.optim.warmup_steps}) exceeds trainer.max_steps ({self.max_steps}): "
                "the warm-up would never reach trainer.optim.lr; lower warmup_steps"
            )
        if self.parallel == "fsdp" and self.data_parallel > 1 and self.lora.enabled:
            raise ValueError(
                "parallel: fsdp does not train LoRA adapters (the adapter and its AdamW state are small): use "
                "parallel: ddp"
            )
        if self.gpus:
            if len(self.gpus) != self.data_parallel:
                raise ValueError(
                    f"gpus lists {len(self.gpus)} devices {self.gpus} for data_parallel={self.data_parallel} ranks: "
                    f"give one per rank, or none"
                )
            if len(set(self.gpus)) != len(self.gpus) or min(self.gpus) < 0:
                raise ValueError(f"gpus must be distinct device indices >= 0, got {self.gpus}")
            if self.device == "cpu":
                raise ValueError(f"gpus {self.gpus} with device: cpu; set device: cuda (or auto), or remove gpus")
        return self
