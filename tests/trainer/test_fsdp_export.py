"""``busctl export`` of a sharded (fsdp) checkpoint of a policy with TIED embeddings
(``lm_head.weight`` is ``embed_tokens.weight``, as in most small instruct models).

The 2-rank export (untied policy, steps trained by torchrun ranks) is checked in
tests/trainer/test_fsdp.py. Here one gloo rank in this process shards the policy with FSDP2 over
a 1-rank mesh (the same DTensor entries and DCP files as more ranks, both tied names among them)
and writes the checkpoint; the process group is destroyed before the export, which reads the
shards with no group: the exported model must be tied again and give the saved model's logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from busctl.export import export_checkpoint, find_checkpoint
from configs.schema import LoraSection
from policies.byte_tokenizer import VOCAB_SIZE, build_tokenizer
from trainer.forward.packed import PackedLogprobs
from trainer.state.model import load_policy
from trainer.parallel.sharding import SHARDED_DIR, read_sharded_policy, save_sharded, shard_policy
from trainer.state.checkpoint import save_checkpoint

MESSAGES = [{"role": "user", "content": "Reverse: abc"}]


@torch.no_grad()
def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model.eval()(torch.tensor([ids])).logits[0]


def test_export_of_a_sharded_tied_policy_is_tied_and_gives_its_logits(tmp_path):
    policy = tmp_path / "policy"
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(policy)
    build_tokenizer().save_pretrained(policy)
    model = load_policy(str(policy), LoraSection())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():  # move every weight (norms start at 1): a loader falling back to init would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = AutoTokenizer.from_pretrained(policy).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    saved = {n: t.clone() for n, t in model.state_dict().items()}
    expected = logits(model, ids)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        shard_policy(PackedLogprobs(model.train()), torch.device("cpu"), 1, bfloat16=False)
        optimizer = torch.optim.AdamW(model.parameters())
        checkpoint = save_checkpoint(
            tmp_path / "run" / "checkpoints",
            step=1,
            model=model,
            optimizer=optimizer,
            extra={},
            write_state=lambda d: save_sharded(model, optimizer, d / SHARDED_DIR),
        )
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()
    assert find_checkpoint(tmp_path / "run", None) == checkpoint
    read = read_sharded_policy(checkpoint / SHARDED_DIR, AutoConfig.from_pretrained(checkpoint))
    assert read.lm_head.weight is read.model.embed_tokens.weight  # one tensor in memory, as trained

    out = export_checkpoint(checkpoint, tmp_path / "exported")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert exported.config.tie_word_embeddings
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    weights = exported.state_dict()
    assert set(weights) == set(saved) and all(torch.equal(weights[n], saved[n]) for n in saved)
    torch.testing.assert_close(logits(exported, ids), expected, rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(out).chat_template == build_tokenizer().chat_template
