"""Import surface of the policy losses; the code lives in the package `trainer.losses` (see its
docstring), whose modules also export every formula as a small pure function.

Use: `policy_loss(LossBatch(...), StepNorm(...), LossSpec.from_config(cfg.trainer.loss))`.
"""

from trainer.losses import LossBatch, LossSpec, StepNorm, loss_counts, policy_loss

__all__ = ["LossBatch", "LossSpec", "StepNorm", "loss_counts", "policy_loss"]
