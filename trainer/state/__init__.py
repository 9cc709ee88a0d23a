"""The trainer's state: ``model`` (the policy, loaded full or with a LoRA adapter, and the weights the
producers receive), ``checkpoint`` (the layout of ``checkpoints/step_N/``, written complete or not
at all; ``hf_files`` the HF files beside it), ``background_save`` (one save at a time off the hot
path) and ``step_ledger`` (custody: which micro-batches the trainer holds, has trained, and may
release once a checkpoint covers their step).
"""
