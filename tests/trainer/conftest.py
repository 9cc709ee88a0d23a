"""Shared fixtures of the trainer tests: a tiny random Qwen2 saved to disk, one torch thread, a
joined control-channel publisher/subscriber pair."""

import pytest
import torch
import zmq
from transformers import Qwen2Config, Qwen2ForCausalLM

from bus.messages import TrainerStep
from bus.sockets import BusSocket
from bus.topics import Endpoints

from tests.torch_threads import one_torch_thread  # noqa: F401 - autouse fixture


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("tiny_qwen2")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture
def channel(tmp_path):
    """(publisher, subscriber): an XPUB bound at the run's control_sub address (as the hub's) and a SUB on
    it, joined."""
    endpoints = Endpoints("ipc", tmp_path)
    endpoints.ensure_dirs()
    ctx = zmq.Context()
    pub = BusSocket(ctx, "control_sub", "send", endpoints.address("control_sub"), bind=True)
    sub = BusSocket(ctx, "control_sub", "recv", endpoints.address("control_sub"), bind=False)
    for _ in range(200):  # slow joiner: publish probes until the subscriber gets one
        pub.send(TrainerStep(id="probe", step=0, version=0, metrics={}))
        if sub.recv(timeout_s=0.02) is not None:
            break
    while sub.recv(timeout_s=0.05) is not None:
        pass
    yield pub, sub
    pub.close()
    sub.close()
    ctx.destroy(linger=0)
