"""The tiny default policy of rlbus: a byte-level tokenizer and a small Qwen3 model.

The default rlbus job (``reverse_text``) must learn under GRPO within minutes on a 2-core CPU
machine, so the policy is tiny (1.1M parameters by default) and its tokenizer works on bytes:

- **Tokenizer.** A ``tokenizers`` BPE over the 256 byte-level symbols with *no merges*, a
  ByteLevel pre-tokenizer and decoder, so token id ``b`` (0..255) is the byte ``b`` and decoding
  gives back exactly the characters generated. Three special tokens follow the bytes:
  ``<|endoftext|>`` (256, pad), ``<|im_start|>`` (257) and ``<|im_end|>`` (258, eos). It is wrapped
  as a transformers ``PreTrainedTokenizerFast`` with a Qwen-style chat template, loads with
  ``AutoTokenizer.from_pretrained`` and inside vLLM.
- **Model.** A ``Qwen3ForCausalLM`` with random init (``build_random_policy``), saved as float32
  safetensors. ``tie_word_embeddings=False``: on vLLM CPU a tied lm_head keeps a stale packed copy
  after a weight reload (see the vLLM CPU notes), so the default policy avoids the trap. Qwen3,
  not Qwen2: for ``model_type == "qwen2"`` transformers 5 ignores the saved tokenizer class and
  loads ``Qwen2Tokenizer``, which swaps in an NFC normalizer and a split regex (so combining
  characters would not round-trip); for ``qwen3`` it honours the saved ``tokenizer.json``.
- **Warm start.** ``ensure_policy`` adds a short, deliberately *partial* supervised run on the
  reverse_text train split (loss on completion tokens only), so that GRPO starts with an eval
  reward in the middle of [0, 1] and has room to improve. The result is cached on disk under a key
  made of every build parameter; it is written to a temporary directory, marked ``DONE`` and
  renamed atomically, so concurrent callers never see a half-written policy.

CLI: ``python -m policies.tiny_model --out DIR [--sft-steps N] [--seed S]`` builds (or finds) the
warm-started policy under the cache directory ``DIR`` and prints its path (``--random``: save
the random policy itself to ``DIR``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any


from policies.byte_tokenizer import (  # noqa: F401  (re-exported: the tiny policy's token ids)
    IM_END_TOKEN_ID,
    IM_START_TOKEN_ID,
    MODEL_MAX_LENGTH,
    NUM_BYTE_TOKENS,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    build_tokenizer,
)
from policies.warm_start import (
    DEFAULT_SFT_BATCH_SIZE,
    DEFAULT_SFT_LR,
    DEFAULT_SFT_STEPS,
    DEFAULT_SFT_TARGET_LOSS,
    DEFAULT_SFT_TASK,
    run_sft,
)

# Head size 32 is the smallest the vLLM CPU attention backend supports.
HEAD_DIM = 32
DEFAULT_HIDDEN_SIZE = 128
DEFAULT_NUM_LAYERS = 4
MAX_POSITION_EMBEDDINGS = MODEL_MAX_LENGTH  # RoPE, no parameters: room for GSM8K prompts (byte tokens, up to ~1.1k)

# Bump when the SFT recipe changes in a way the cache key does not see.
_RECIPE_VERSION = 3  # 3: max_position_embeddings 512 -> 2048
DONE_MARKER = "DONE"


def build_random_policy(
    out_dir: Path,
    *,
    hidden_size: int = DEFAULT_HIDDEN_SIZE,
    num_layers: int = DEFAULT_NUM_LAYERS,
    seed: int = 0,
) -> Path:
    """Save a randomly initialised tiny Qwen3 policy and its tokenizer to ``out_dir``.

    Args:
        out_dir: directory to write (created; existing files with the same names are replaced).
        hidden_size: model width; a multiple of ``HEAD_DIM`` (32). Heads = hidden_size / 32,
            MLP width = 4 * hidden_size.
        num_layers: number of decoder layers.
        seed: torch seed for the random init (same seed -> same weights).

    Returns:
        ``out_dir``, holding ``config.json``, ``generation_config.json``, ``model.safetensors``
        (float32, untied ``lm_head``) and the tokenizer files. The default size (128 wide, 4
        layers) has 1,116,288 parameters (4.5 MB in float32).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    if hidden_size <= 0 or hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size must be a positive multiple of {HEAD_DIM}, got {hidden_size}")
    if num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    num_heads = hidden_size // HEAD_DIM
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=IM_END_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        use_sliding_window=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=IM_END_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, bos_token_id=None
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer().save_pretrained(out_dir)
    return out_dir


def count_parameters(model: Any) -> int:
    """Number of scalar parameters of a torch module (int)."""
    return sum(p.numel() for p in model.parameters())


def policy_cache_key(params: dict[str, Any]) -> str:
    """Stable 16-hex-digit key of the build parameters (JSON with sorted keys, sha256)."""
    blob = json.dumps(params, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def ensure_policy(
    cache_dir: Path,
    *,
    sft_steps: int = DEFAULT_SFT_STEPS,
    seed: int = 0,
    hidden_size: int = DEFAULT_HIDDEN_SIZE,
    num_layers: int = DEFAULT_NUM_LAYERS,
    sft_batch_size: int = DEFAULT_SFT_BATCH_SIZE,
    sft_lr: float = DEFAULT_SFT_LR,
    sft_target_loss: float | None = DEFAULT_SFT_TARGET_LOSS,
    task: str = DEFAULT_SFT_TASK,
) -> Path:
    """Return the directory of the warm-started tiny policy, building it if not cached.

    The policy is ``build_random_policy(hidden_size, num_layers, seed)`` followed by
    ``run_sft`` on ``task``'s train split: at most ``sft_steps`` steps of ``sft_batch_size``
    examples at ``sft_lr``, stopping early once the windowed loss reaches ``sft_target_loss``
    (``None``: always run ``sft_steps``; ``sft_steps=0``: the random policy). With the defaults
    the SFT stops at loss 1.7 nats/token (72-205 steps for seeds 0-11; 7-50 s on 2 shared
    cores) and the policy scores an eval reward of 0.33-0.40 at temperature 1.0. It lives at
    ``cache_dir / f"{task}-{key}"`` where ``key`` hashes all these parameters; a directory counts
    as built only with its ``DONE`` marker (JSON: parameters and SFT stats). Building writes to a
    temporary sibling and renames it, so concurrent callers are safe (the loser of a race discards
    its copy).

    Raises:
        ValueError: on a negative ``sft_steps`` or a non-positive ``sft_batch_size``,
            ``sft_lr`` or ``sft_target_loss``.
    """
    if sft_steps < 0:
        raise ValueError(f"sft_steps must be >= 0, got {sft_steps}")
    if sft_batch_size <= 0:
        raise ValueError(f"sft_batch_size must be positive, got {sft_batch_size}")
    if sft_lr <= 0:
        raise ValueError(f"sft_lr must be positive, got {sft_lr}")
    if sft_target_loss is not None and sft_target_loss <= 0:
        raise ValueError(f"sft_target_loss must be positive or None, got {sft_target_loss}")
    params = {
        "recipe_version": _RECIPE_VERSION,
        "task": task,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "seed": seed,
        "sft_steps": sft_steps,
        "sft_batch_size": sft_batch_size,
        "sft_lr": sft_lr,
        "sft_target_loss": sft_target_loss,
    }
    cache_dir = Path(cache_dir)
    final = cache_dir / f"{task}-{policy_cache_key(params)}"
    if (final / DONE_MARKER).exists():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        build_random_policy(tmp, hidden_size=hidden_size, num_layers=num_layers, seed=seed)
        stats: dict[str, float] = {}
        if sft_steps > 0:
            stats = run_sft(
                tmp,
                task=task,
                sft_steps=sft_steps,
                batch_size=sft_batch_size,
                lr=sft_lr,
                seed=seed,
                target_loss=sft_target_loss,
            )
        (tmp / DONE_MARKER).write_text(json.dumps({"params": params, "sft": stats}, indent=2))
        if final.exists() and not (final / DONE_MARKER).exists():
            # Left by a crashed build that got as far as the rename: impossible with rename
            # semantics, but never trust a directory without its marker.
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / DONE_MARKER).exists():
                raise
            # Another process won the race; its copy is equivalent.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> None:
    """CLI: build or find the warm-started policy and print its directory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="cache directory")
    parser.add_argument("--sft-steps", type=int, default=DEFAULT_SFT_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=DEFAULT_HIDDEN_SIZE)
    parser.add_argument("--num-layers", type=int, default=DEFAULT_NUM_LAYERS)
    parser.add_argument("--sft-target-loss", type=float, default=DEFAULT_SFT_TARGET_LOSS, help="<= 0: none")
    parser.add_argument("--random", action="store_true", help="save the random policy to --out")
    args = parser.parse_args(argv)
    if args.random:
        path = build_random_policy(args.out, hidden_size=args.hidden_size, num_layers=args.num_layers, seed=args.seed)
    else:
        path = ensure_policy(
            args.out,
            sft_steps=args.sft_steps,
            seed=args.seed,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            sft_target_loss=args.sft_target_loss if args.sft_target_loss > 0 else None,
        )
    print(path)


if __name__ == "__main__":
    main()
