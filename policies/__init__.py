"""The policies rlbus builds itself, as a library: used by ``busctl up`` (the default run's tiny
policy is built or reused before any component starts), by ``bench/`` and by tests, with no trainer
running. ``tiny_model`` (the tiny default policy, a small Qwen3, built once and cached;
:func:`policies.tiny_model.ensure_policy`), ``byte_tokenizer`` (its byte-level chat tokenizer, no
model files), ``warm_start`` (the short supervised run it starts from, on a task's train split),
``model_families`` (tiny random models of Qwen2.5, Qwen3 and Llama-3 for tests and benches) and
``chat_templates`` (those families' chat templates as their tokenizers ship them).
"""
