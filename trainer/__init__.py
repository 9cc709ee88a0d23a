"""The trainer stage: GRPO optimizer steps on packed micro-batches from the ``batches`` topic, weights
out to the producers after each step.

At the top: ``proc`` (the process: sockets, custody, checkpoints, resume), ``trainer`` (the logic
of one optimizer step, socket-free), ``publish`` (weight publication by the run's method),
``model`` (loading the policy, full or LoRA). The sub-packages each hold one concern:
``forward`` (the packed forward and its logprobs: packed and shared-prefix rows, varlen attention
on CPU, memory-lean logprobs, the reference policy, precision), ``kernels`` (the CUDA/Triton
kernels those call: flash varlen attention, fused logprob and entropy), ``losses`` (the policy-loss
family, one pure function per formula), ``parallel`` (data parallelism, FSDP, device and threads),
``state`` (checkpoints and custody) and ``observability`` (per-step metrics and eval records).
"""
