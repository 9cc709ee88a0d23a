"""The policies rlbus builds itself, as a library for ``busctl up`` (the default run's tiny policy), ``bench/`` and
tests, with no trainer running: the tiny default policy and its warm start, its byte-level tokenizer, and tiny
random models of Qwen2.5, Qwen3 and Llama-3 with their chat templates.
"""
