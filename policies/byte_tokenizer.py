"""The byte-level chat tokenizer of rlbus's tiny policies (no model files, no merges).

A ``tokenizers`` BPE over the 256 byte-level symbols with *no merges*, a ByteLevel pre-tokenizer
and decoder, so token id ``b`` (0..255) is the byte ``b`` and decoding gives back exactly the
characters generated. Three special tokens follow the bytes: ``<|endoftext|>`` (256, pad),
``<|im_start|>`` (257) and ``<|im_end|>`` (258, eos). Used by the tiny default policy
(:mod:`policies.tiny_model`) and, with each family's own specials and template, by the tiny models
of the real families (:mod:`policies.model_families`).
"""

from __future__ import annotations

from typing import Any

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
NUM_BYTE_TOKENS = 256
PAD_TOKEN_ID = NUM_BYTE_TOKENS  # 256
IM_START_TOKEN_ID = NUM_BYTE_TOKENS + 1  # 257
IM_END_TOKEN_ID = NUM_BYTE_TOKENS + 2  # 258
VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)  # 259

# Qwen2.5-style template without the default system prompt: every message renders as
# "<|im_start|>{role}\n{content}<|im_end|>\n"; add_generation_prompt appends
# "<|im_start|>assistant\n".
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Longest sequence the tokenizer is declared for (the tiny policy's RoPE range).
MODEL_MAX_LENGTH = 2048


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map, the one the ByteLevel pre-tokenizer uses.

    Returns: ``{byte value 0..255: one-character str}``. Printable ASCII and most Latin-1 bytes
    map to themselves; the rest map to code points from 256 upwards.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes)}


def build_tokenizer() -> Any:
    """Build the byte-level chat tokenizer (no model files needed).

    Returns:
        A transformers ``PreTrainedTokenizerFast`` with ``len(tok) == VOCAB_SIZE == 259``: ids
        0..255 are the raw bytes, 256 ``<|endoftext|>`` (pad), 257 ``<|im_start|>``, 258
        ``<|im_end|>`` (eos), and ``chat_template`` set to ``CHAT_TEMPLATE``. ``encode`` adds no
        BOS/EOS; ``decode(encode(s)) == s`` for every str ``s``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(NUM_BYTE_TOKENS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: with no merges the GPT-2 split regex changes nothing but costs time.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.token_to_id(PAD_TOKEN) == PAD_TOKEN_ID
    assert tok.token_to_id(IM_END_TOKEN) == IM_END_TOKEN_ID
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END_TOKEN,
        additional_special_tokens=[IM_START_TOKEN],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
