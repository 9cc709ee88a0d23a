"""The device kernels the forward calls: ``varlen_attention`` (flash-attention's varlen kernel over
``cu_seqlens``, with what the installed torch offers detected) and ``triton_logprobs`` (fused
log-softmax, gather and entropy of a logits chunk, and its backward)."""
