"""The device level below the forward: flash varlen attention, Triton logprob kernels, queued copies."""
