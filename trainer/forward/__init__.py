"""The trainer's packed forward: per-token logprobs of padding-free packed rows, shared prefixes, the
chunked LM head, the frozen KL reference policy and the compute dtype.
"""
