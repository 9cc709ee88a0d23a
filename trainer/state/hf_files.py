"""The files that make a checkpoint a complete Hugging Face model directory besides its weights
(``save_pretrained`` writes no tokenizer, and peft's no base generation config), copied from the
directory the policy was loaded from; a source without a tokenizer is logged and skipped.
"""

from __future__ import annotations

import copy
import functools
import logging
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoTokenizer, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

__all__ = ["model_source", "write_config", "write_model_files"]


def model_source(model: torch.nn.Module) -> str:
    """The directory (or hub id) ``model`` (peft unwrapped) was loaded from; "" if built in memory."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    return str(getattr(base, "name_or_path", "") or "")


@functools.lru_cache(maxsize=4)
def _tokenizer(source: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer at ``source`` (loaded once per source and process), None if it has none."""
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as err:  # no tokenizer files, or none transformers can build
        log.warning(
            "no tokenizer at %s (%s): checkpoints hold no tokenizer and cannot be served as they are", source, err
        )
        return None


def write_model_files(directory: Path, model: torch.nn.Module, *, with_config: bool = False) -> None:
    """Write the tokenizer and chat template (and for LoRA the base's generation config) of
    ``model``'s source into ``directory`` (none without a source or tokenizer; logged once);
    ``with_config``: also :func:`write_config`, for a sharded save."""
    if with_config:
        write_config(directory, model)
    source = model_source(model)
    if not source:
        return
    tokenizer = _tokenizer(source)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    if isinstance(model, PeftModel):
        generation = getattr(model.get_base_model(), "generation_config", None)
        if generation is not None:
            generation.save_pretrained(directory)


def write_config(directory: Path, model: torch.nn.Module) -> None:
    """Write ``config.json`` and ``generation_config.json`` of the transformers model under
    ``model`` into the existing ``directory``, with the ``dtype`` (the parameters') and
    ``architectures`` that ``save_pretrained`` would set; the model's config is not changed."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    config = copy.deepcopy(base.config)
    dtype = next((p.dtype for p in base.parameters() if p.dtype.is_floating_point), None)
    if dtype is not None:
        config.dtype = str(dtype).removeprefix("torch.")
    config.architectures = [type(base).__name__.removeprefix("FSDP")]  # FSDP2 renames the class FSDP<Name>
    config.save_pretrained(directory)
    generation = getattr(base, "generation_config", None)
    if generation is not None and base.can_generate():
        generation.save_pretrained(directory)
