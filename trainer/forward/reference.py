"""The frozen reference policy of the KL penalty (`trainer.loss.kl_reference: reference`).

It is the policy the run started from. LoRA: the base model with the adapter off (peft's
`disable_adapter()`, no extra memory); full fine-tuning: a frozen deep copy taken when the trainer
is built, before a resume loads trained weights. Its logprobs use the policy's packed forward,
temperature and head dtype, inside the policy's autocast, so at step 0 they equal the policy's
exactly and the KL penalty starts at 0.
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
    """Per-token logprobs of packed samples under the frozen reference policy.

    Args:
        policy: the policy being trained (HF causal LM or peft `PeftModel`), still at its initial weights.
        share_prefixes, head_dtype: as the policy's (`trainer.share_prefixes`, `trainer.lm_head_dtype`).
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
        """`[T]` float32 reference logprobs (nats, 0 at each sample's first token), no grad.

        Args:
            input_ids: `[T]` integer packed token ids. seq_lens: `[S]` integer sample lengths.
            temperature: the samples' sampling temperature.
            tokens: `[T]` bool or None: only these tokens' logprobs are computed (0 elsewhere).

        Raises:
            ValueError: temperature is not a finite number > 0.
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
