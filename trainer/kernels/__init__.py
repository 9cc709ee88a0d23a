"""The device level below the forward: ``varlen_attention`` (flash-attention's varlen kernel over
``cu_seqlens``, with what the installed torch offers detected), ``triton_logprobs`` (fused
log-softmax, gather and entropy of a logits chunk, and its backward) and ``transfer`` (host arrays
to the device as queued copies, without a host sync)."""
