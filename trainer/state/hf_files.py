"""The files that make a checkpoint a complete Hugging Face model directory besides its weights.

``save_pretrained`` of a transformers model writes ``config.json``, ``generation_config.json``
and the weights; peft's writes ``adapter_config.json`` and the adapter. Neither writes the
tokenizer, so a checkpoint could not be a new run's ``model.path``, loaded with ``AutoTokenizer``,
or served by vLLM. :func:`write_model_files` adds what is missing, taken from the directory the
policy was loaded from (the run's ``model.path``, which :func:`trainer.state.model.load_policy` resolves
to a local directory and transformers keeps as the model's ``name_or_path``):

- the tokenizer, through ``AutoTokenizer.from_pretrained(source).save_pretrained(dir)``
  (``tokenizer.json``, ``tokenizer_config.json``, special tokens and the chat template,
  ``chat_template.jinja``), so a checkpoint of a run started from a checkpoint has them too;
- for a LoRA policy, ``generation_config.json`` of the base model (peft saves the adapter only;
  ``adapter_config.json``'s ``base_model_name_or_path`` names the base directory, from which
  ``AutoModelForCausalLM``/``PeftModel`` load the frozen weights and ``busctl export
  --merge-lora`` merges, :mod:`busctl.export`).
- for a sharded checkpoint (``trainer.parallel: fsdp``: its weights are torch.distributed.checkpoint
  shards, not ``save_pretrained``'s files), ``config.json`` and ``generation_config.json`` of the
  model (``with_config=True``), so the directory still says what model it is and ``busctl export``
  builds that model to read the shards into.

A source without a tokenizer (a bare weights directory) is logged and skipped: training does not
stop for it, the checkpoint is then not self-contained.
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
    """The directory (or hub id) the transformers model under ``model`` (peft unwrapped) was
    loaded from: its ``name_or_path``; "" when it was built in memory."""
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
    """Write the tokenizer (and, for LoRA, the base model's generation config) of ``model``'s
    source directory into ``directory``, beside the weights ``save_pretrained`` wrote.

    Args:
        directory: the checkpoint directory being written (the save's temp directory).
        model: the training model, a transformers model or a peft model over one (its
            parameters may be FSDP-sharded DTensors: only their dtype is read).
        with_config: also write the model's ``config.json`` and ``generation_config.json``, as
            ``save_pretrained`` would (:func:`write_config`): a sharded save writes no
            ``save_pretrained`` files.

    Writes no tokenizer when the model has no source directory or the source has none (logged
    once per source).
    """
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
    ``model`` (peft unwrapped) into ``directory``, with the fields ``save_pretrained`` sets on the
    way (transformers ``PreTrainedModel.save_pretrained``): ``dtype`` = the parameters' dtype
    (e.g. float32 master weights of a model loaded in bfloat16) and ``architectures`` = the
    model class. The model's own config object is not changed.

    Args:
        directory: an existing directory.
        model: a transformers model or a peft model over one; its parameters may be DTensors.
    """
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
