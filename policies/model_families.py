"""Tiny random models of the real families rlbus trains (Qwen2.5, Qwen3, Llama-3), for tests and benches.

Each is the family's architecture at toy size with random weights, saved as a HF model directory whose byte-level
tokenizer (ids 0..255 the bytes, no merges: ``decode(encode(s)) == s``) carries the family's real chat template,
special tokens and EOS setup (:data:`FAMILIES`; docs/models.md). Sizes: :data:`TINY` for tests (4 query heads of
32: the smallest head vLLM's CPU attention takes; 2 KV heads: GQA) and :data:`QWEN2_5_0_5B` for benches.
``tied=True`` ties ``lm_head`` to the embeddings (Qwen2.5 <= 3B, Qwen3 <= 4B), ``False`` does not (Llama-3 8B).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies.chat_templates import LLAMA3_TEMPLATE, QWEN2_5_TEMPLATE, QWEN3_TEMPLATE
from policies.byte_tokenizer import NUM_BYTE_TOKENS, bytes_to_unicode
from policies.tiny_model import HEAD_DIM


@dataclass(frozen=True)
class Family:
    """One model family's tokenizer and config conventions: ``specials`` are ``(token, special)`` after the 256 bytes
    in id order (``special=False`` tokens survive ``skip_special_tokens``, as Qwen3's ``<think>``); ``stop`` is
    ``generation_config.eos_token_id`` in order; ``bos`` None: none."""

    name: str
    architecture: str
    specials: tuple[tuple[str, bool], ...]
    eos: str
    pad: str
    bos: str | None
    stop: tuple[str, ...]
    chat_template: str
    rope_theta: float

    def token_id(self, token: str) -> int:
        """The id of special ``token`` (``256 + its position``); ValueError if it is not one."""
        names = [t for t, _ in self.specials]
        if token not in names:
            raise ValueError(f"{token!r} is not a special token of {self.name} ({names})")
        return NUM_BYTE_TOKENS + names.index(token)

    @property
    def vocab_size(self) -> int:
        """Bytes plus special tokens."""
        return NUM_BYTE_TOKENS + len(self.specials)

    @property
    def stop_ids(self) -> list[int]:
        """``generation_config.eos_token_id``: the ids that end a completion."""
        return [self.token_id(t) for t in self.stop]


_QWEN_SPECIALS = (("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True))
FAMILIES: dict[str, Family] = {
    "qwen2.5": Family(
        "qwen2.5",
        "Qwen2ForCausalLM",
        _QWEN_SPECIALS,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        bos=None,
        stop=("<|im_end|>", "<|endoftext|>"),
        chat_template=QWEN2_5_TEMPLATE,
        rope_theta=1_000_000.0,
    ),
    "qwen3": Family(
        "qwen3",
        "Qwen3ForCausalLM",
        _QWEN_SPECIALS + (("<think>", False), ("</think>", False), ("<tool_call>", False), ("</tool_call>", False)),
        eos="<|im_end|>",
        pad="<|endoftext|>",
        bos=None,
        stop=("<|im_end|>", "<|endoftext|>"),
        chat_template=QWEN3_TEMPLATE,
        rope_theta=1_000_000.0,
    ),
    "llama3": Family(
        "llama3",
        "LlamaForCausalLM",
        (
            ("<|begin_of_text|>", True),
            ("<|end_of_text|>", True),
            ("<|start_header_id|>", True),
            ("<|end_header_id|>", True),
            ("<|eot_id|>", True),
        ),
        eos="<|eot_id|>",
        pad="<|end_of_text|>",
        bos="<|begin_of_text|>",
        stop=("<|end_of_text|>", "<|eot_id|>"),
        chat_template=LLAMA3_TEMPLATE,
        rope_theta=500_000.0,
    ),
}
"""The supported families by key."""

MAX_POSITION_EMBEDDINGS = 2048


@dataclass(frozen=True)
class Shape:
    """Model size (GQA when ``num_kv_heads < num_heads``); ``vocab_size`` None: the tokenizer's, larger pads the
    embedding like real checkpoints (Qwen2.5: 151,936 rows for 151,665 tokens)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = HEAD_DIM
    vocab_size: int | None = None


TINY = Shape(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256)
"""The test size: 2 layers, 4 query heads of 32 (the smallest head vLLM's CPU attention takes), 2 KV heads."""
QWEN2_5_0_5B = Shape(
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    head_dim=64,
    vocab_size=151_936,
)
"""Qwen2.5-0.5B's shape (494,032,768 parameters with ``tied=True``, as it ships): for benches."""


def family(name: str) -> Family:
    """The :class:`Family` called ``name``; ValueError naming the known ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def build_family_tokenizer(name: str) -> Any:
    """The byte-level tokenizer of family ``name`` (a ``PreTrainedTokenizerFast``): the bytes, then
    ``Family.specials``; ``encode`` adds no special tokens (the Llama-3 template writes ``<|begin_of_text|>``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fam = family(name)
    byte_to_char = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(NUM_BYTE_TOKENS)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in fam.specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=fam.eos,
        pad_token=fam.pad,
        bos_token=fam.bos,
        chat_template=fam.chat_template,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )


def family_config(name: str, *, tied: bool, shape: Shape = TINY) -> Any:
    """The transformers config of a family-``name`` model of ``shape`` (float32, ``tie_word_embeddings=tied``,
    the family's RoPE base and bos / eos / pad ids). ValueError: unknown family, or a ``shape.vocab_size``
    smaller than the tokenizer's."""
    from transformers import AutoConfig

    fam = family(name)
    if shape.vocab_size is not None and shape.vocab_size < fam.vocab_size:
        raise ValueError(f"shape.vocab_size={shape.vocab_size} is below the {name} tokenizer's {fam.vocab_size} tokens")
    model_type = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}[
        fam.architecture
    ]
    extra = {} if model_type == "llama" else {"use_sliding_window": False}
    if model_type != "qwen2":  # qwen2 derives head_dim = hidden_size / heads
        extra["head_dim"] = shape.head_dim
    elif shape.hidden_size != shape.num_heads * shape.head_dim:
        raise ValueError(f"qwen2 needs hidden_size == num_heads * head_dim, got {shape}")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=shape.vocab_size or fam.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rope_theta=fam.rope_theta,
        tie_word_embeddings=tied,
        bos_token_id=fam.token_id(fam.bos) if fam.bos else None,
        eos_token_id=fam.token_id(fam.eos),
        pad_token_id=fam.token_id(fam.pad),
        dtype="float32",
        **extra,
    )
    config.architectures = [fam.architecture]
    return config


def build_family_model(out_dir: str | Path, name: str, *, tied: bool, seed: int = 0, shape: Shape = TINY) -> Path:
    """Save a random float32 model of family ``name`` (``seed``: torch's) with its tokenizer to ``out_dir``
    (created; ``generation_config.json`` has ``eos_token_id`` = ``Family.stop_ids``) and return it.

    Raises:
        ValueError: as :func:`family_config`.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    fam = family(name)
    config = family_config(name, tied=tied, shape=shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=fam.stop_ids,
        pad_token_id=fam.token_id(fam.pad),
        bos_token_id=fam.token_id(fam.bos) if fam.bos else None,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    build_family_tokenizer(name).save_pretrained(out)
    return out
