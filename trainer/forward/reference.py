"""The frozen reference policy of the KL penalty (`trainer.loss.kl_reference: reference`).

The reference is the policy the run STARTED from (the model at `model.path`), never updated:
- LoRA: the base model with the adapter switched off (peft's `disable_adapter()` context), so the
  reference costs no memory at all;
- full fine-tuning: a deep copy of the policy taken when the trainer is built, before any step
  and before a resume loads trained weights (the trainer process builds its `Trainer` first and
  restores the checkpoint afterwards), frozen (`requires_grad=False`, eval mode).

Invariants: reference logprobs carry no gradient and are computed with the same packed forward
(`trainer.forward.packed.packed_logprobs_and_entropy`) and the same sampling temperature as the policy's
(the micro-batch's `MicroBatch.temperature`, given per call), and in the policy's compute dtype:
the trainer calls `logprobs` inside the same autocast context as the policy's forward
(`trainer.forward.precision`; bfloat16 matmuls with `trainer.dtype: bfloat16`, logprobs float32), so at
step 0 the reference's logprobs equal the policy's exactly and the KL penalty starts at 0, not at
the bfloat16-vs-float32 rounding gap. The copy's weights stay float32 (autocast casts them per op).
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
        policy: the policy being trained (HF causal LM, possibly a peft `PeftModel`), still at its
            initial weights.
        share_prefixes: run shared sample prefixes once (`trainer.forward.shared_prefix`), as the policy's
            forward does (`trainer.share_prefixes`).
        head_dtype: the LM head's matmul precision, as the policy's (`trainer.lm_head_dtype`), so
            the KL starts at 0.
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
        """`[T]` float32 reference logprobs (nats, 0 at each sample's first token), no grad:
        `log softmax(logits / temperature)` at each token (`packed_logprobs_and_entropy`).

        Args:
            input_ids: `[T]` integer packed token ids. seq_lens: `[S]` integer sample lengths
                (host arrays: no host sync, `trainer.forward.packed_row`; or tensors).
            temperature: finite float > 0, the samples' sampling temperature.
            tokens: `[T]` bool (host or device) or None: only these tokens' logprobs are computed (0 elsewhere).

        Raises:
            ValueError: temperature is not a finite number > 0 (raised by the packed forward).
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
