"""What the trainer keeps so that a killed trainer resumes bit-identically: ``checkpoint`` (the
layout of ``checkpoints/step_N/``: weights or LoRA adapter, optimizer and RNG states, the step
ledger; written complete or not at all), ``background_save`` (one save at a time on a background
thread, off the hot path) and ``step_ledger`` (custody: which micro-batches the trainer holds, has
trained, and may release once a checkpoint covers their step).
"""
