"""The trainer's packed forward: ``packed`` (per-token logprobs of padding-free packed rows),
``packed_attention`` (causal attention per packed sample, registered with transformers),
``shared_prefix`` (a group's prompt through the decoder once), ``logprobs`` (chunked LM-head
logprobs and entropy, no ``[T, V]`` logits), ``reference`` (the frozen KL reference policy) and
``precision`` (``trainer.dtype``: the compute dtype)."""
