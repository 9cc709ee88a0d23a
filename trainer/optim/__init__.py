"""The trainer's optimizer side: ``lr_schedule`` (the learning-rate schedule of
``trainer.optim``: warm-up, then constant, linear or cosine decay to a minimum ratio, as a torch
``LambdaLR`` that checkpoints save and restore). AdamW itself is built by
:func:`trainer.trainer.build_optimizer`.
"""
