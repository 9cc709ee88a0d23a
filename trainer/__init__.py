"""The trainer stage: GRPO optimizer steps on packed micro-batches from the ``batches`` topic, weights
out to the producers after each step.

At the top: ``proc`` (rank 0's process: sockets, custody, checkpoints, resume), ``dp_follower`` (the
data-parallel ranks > 0, no bus), ``trainer`` (one optimizer step, socket-free) and ``publish``
(weight publication by the run's method). Each sub-package holds one concern and imports nothing
from this top level: ``forward`` (the packed forward and its logprobs), ``kernels`` (the CUDA/Triton
kernels and host-to-device copies below it), ``losses`` (the policy-loss family), ``parallel`` (data
parallelism, FSDP, device and threads), ``state`` (the policy's weights, checkpoints and custody),
``optim`` (the learning-rate schedule) and ``observability`` (per-step metrics and eval records).
"""
