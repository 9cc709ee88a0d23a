"""The frozen reference policy of the KL penalty (`trainer.loss.kl_reference: reference`).

LoRA: the policy with its adapter off (no extra memory); full fine-tuning: a frozen copy taken before
a resume loads trained weights. Same packed forward, head dtype and autocast as the policy, so at step
0 the logprobs are equal and the KL starts at 0.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import torch
from peft import PeftModel

from trainer.forward.packed import packed_logprobs_and_entropy

__all__ = ["ReferencePolicy"]


class ReferencePolicy:
    """Reference logprobs of `policy` (HF causal LM or `PeftModel`, still at its initial weights);
    `share_prefixes`, `head_dtype` as the policy's.
    """

    def __init__(
        self, policy: torch.nn.Module, *, share_prefixes: bool | str = False, head_dtype: str = "float32"
    ) -> None:
        self.share_prefixes = share_prefixes
        self.head_dtype = head_dtype
        if isinstance(policy, PeftModel):
            self.model = policy
            self.shares_policy = True
            """True: the reference is the policy with its adapter disabled (LoRA)."""
        else:
            self.model = copy.deepcopy(policy).eval().requires_grad_(False)
            self.shares_policy = False

    @torch.no_grad()
    def logprobs(
        self,
        input_ids: torch.Tensor | np.ndarray,
        seq_lens: torch.Tensor | np.ndarray,
        temperature: float,
        tokens: torch.Tensor | np.ndarray | None = None,
    ) -> torch.Tensor:
        """`[T]` float32 logprobs (nats, 0 at sample starts), no grad, of `input_ids` `[T]` split by `seq_lens`
        `[S]`; `tokens` `[T]` bool or None. ValueError for a temperature not a finite number > 0.
        """
        context = self.model.disable_adapter() if self.shares_policy else contextlib.nullcontext()
        with context:
            logprobs, _entropy = packed_logprobs_and_entropy(
                self.model,
                input_ids,
                seq_lens,
                temperature=temperature,
                share_prefixes=self.share_prefixes,
                tokens=tokens,
                head_dtype=self.head_dtype,
            )
        return logprobs.detach()
