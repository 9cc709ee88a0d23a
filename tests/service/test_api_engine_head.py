"""The API trainer's LoRA clients with ``train_unembed`` (the Tinker SDK's default): the LM head trains in full
beside the adapter, a saved state round-trips exactly (head and AdamW state), peft reads the checkpoint as a
saved head, the sampler weights carry the trained head, and loading into a client with the other setting is
refused with the SDK's ``user`` category. In process on :class:`trainer.api.engine.ApiEngine` (no server)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bus.messages import new_id
from bus.messages_api import ApiCall
from configs.schema import load_config
from policies.tiny_model import build_random_policy
from trainer.api.engine import ApiEngine

TOKENS = list(range(40, 60))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api_head")
    policy = build_random_policy(tmp / "policy", seed=0)
    cfg = load_config(None, [f"model.path={policy}", f"run_dir={tmp / 'run'}"])
    return ApiEngine(cfg, tmp / "run"), policy, tmp / "run"


def call(eng: ApiEngine, op: str, model_id: str, body: dict, rows: list[list[int]] | None = None):
    ids = TOKENS[:-1] if rows is not None else []
    reply = eng.handle(
        ApiCall(
            id=new_id(),
            op=op,
            model_id=model_id,
            body=body,
            token_ids=np.asarray(ids, np.int64),
            datum_lens=np.asarray([len(ids)] if rows is not None else [], np.int64),
            loss_inputs=np.asarray(rows if rows is not None else np.zeros((0, 0)), np.float64),
        )
    )
    return reply


def forward(eng: ApiEngine, model_id: str) -> np.ndarray:
    body = {"loss_fn": "cross_entropy", "loss_inputs": ["target_tokens"], "forward_only": True}
    reply = call(eng, "forward_backward", model_id, body, [TOKENS[1:]])
    assert reply.ok, reply.error
    return reply.outputs[0]


@pytest.mark.parametrize("unembed", [True, False])
def test_train_unembed_trains_saves_and_samples_the_head(engine, unembed):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    eng, policy, run_dir = engine
    a, b = f"a{unembed}", f"b{unembed}"
    lora = {"rank": 4, "seed": 0, "train_unembed": unembed}
    assert call(eng, "create_model", a, {"base_model": str(policy), "lora": lora}).ok
    head0 = eng.models[a].model.get_output_embeddings().weight.detach().clone()
    for _ in range(3):
        body = {"loss_fn": "cross_entropy", "loss_inputs": ["target_tokens"]}
        assert call(eng, "forward_backward", a, body, [TOKENS[1:]]).ok
        assert call(eng, "optim_step", a, {"adam_params": {"learning_rate": 1e-2}}).ok
    moved = (eng.models[a].model.get_output_embeddings().weight - head0).abs().max().item()
    assert (moved > 1e-3) if unembed else (moved == 0.0), moved

    saved = call(eng, "save_weights", a, {"name": "s"})
    assert saved.ok, saved.error
    assert call(eng, "load_weights", b, {"path": saved.body["path"], "optimizer": True}).ok
    np.testing.assert_array_equal(forward(eng, a), forward(eng, b))  # the round trip is exact

    base = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, run_dir / "api" / a / "weights" / "s").eval()
    with torch.no_grad():
        logits = peft_model(input_ids=torch.tensor([TOKENS[:-1]])).logits[0]
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0].numpy()
    assert np.abs(lp - forward(eng, a)).max() < 1e-5  # peft reads the saved head

    sampler = call(eng, "save_weights", a, {"kind": "sampler"})
    assert sampler.ok, sampler.error
    head = load_file(Path(sampler.body["weights_dir"]) / "model.safetensors")["lm_head.weight"]
    assert torch.equal(head, eng.models[a].model.get_output_embeddings().weight.detach())


def test_loading_a_state_with_the_other_train_unembed_is_a_user_error(engine):
    eng, policy, _ = engine
    lora = {"rank": 4, "seed": 0, "train_unembed": True}
    assert call(eng, "create_model", "src", {"base_model": str(policy), "lora": lora}).ok
    path = call(eng, "save_weights", "src", {"name": "m"}).body["path"]
    assert call(eng, "create_model", "dst", {"base_model": str(policy), "lora": {"rank": 4, "train_unembed": False}}).ok
    reply = call(eng, "load_weights", "dst", {"path": path})
    assert not reply.ok and reply.category == "user" and "train_unembed" in reply.error, reply.error
