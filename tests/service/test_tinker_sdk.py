"""``busctl serve`` driven by the official Tinker SDK (0.38): a LoRA training client's SFT loss falls over a few
steps (forward_backward + optim_step, futures polled by the SDK); forward_only leaves the weights alone; a
wrong or missing key gets 401; a bad call fails with the SDK's ``user`` category; a retried ``(model_id,
seq_id)`` gets the first copy's request id, and chunks sent out of order run in seq_id order.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.service.conftest import API_KEY

tinker = pytest.importorskip("tinker", reason="the Tinker SDK is in the test extra")


def sft_datum(text: bytes):
    from tinker import types

    toks = list(text)
    return types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(toks[1:], dtype=np.int64),
            "weights": np.ones(len(toks) - 1, dtype=np.float32),
        },
    )


@pytest.fixture(scope="module")
def client(served):
    sc = tinker.ServiceClient(base_url=served.url, api_key=API_KEY)
    yield sc


def test_sft_loss_falls_and_forward_only_trains_nothing(client, served):
    from tinker import types

    tc = client.create_lora_training_client(base_model=str(served.policy), rank=4, seed=0).result()
    data = [sft_datum(b"hello world, reverse me"), sft_datum(b"the quick brown fox")]
    before = tc.forward(data, "cross_entropy").result()
    again = tc.forward(data, "cross_entropy").result()
    assert again.metrics["loss:sum"] == before.metrics["loss:sum"]  # forward_only: no gradient kept, no step
    n_tokens = sum(len(d.loss_fn_inputs["weights"].data) for d in data)
    lp = np.concatenate([o["logprobs"].to_numpy() for o in before.loss_fn_outputs])
    assert lp.shape == (n_tokens,) and (lp < 0).all()
    assert before.metrics["loss:sum"] == pytest.approx(-lp.sum(), rel=1e-5)  # a sum, not a mean
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(data, "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(fb.result().metrics["loss:sum"])
        assert step.result().metrics["grad_norm:mean"] > 0
    after = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert losses[0] == pytest.approx(before.metrics["loss:sum"], rel=1e-5)
    assert all(b < a for a, b in zip([*losses, after], [*losses, after][1:])), (losses, after)  # falls every step
    assert after < 0.9 * before.metrics["loss:sum"], (before.metrics, losses, after)
    info = tc.get_info()
    assert info.is_lora and info.lora_rank == 4 and info.model_data.tokenizer_id == str(served.policy)


def test_a_bad_call_fails_with_the_user_category(client, served):
    tc = client.create_lora_training_client(base_model=str(served.policy), rank=2).result()
    with pytest.raises(tinker.RequestFailedError) as err:
        tc.forward_backward([sft_datum(b"abc")], "no_such_loss").result()
    assert err.value.category == tinker.types.RequestErrorCategory.User
    with pytest.raises(Exception, match="not served"):
        client.create_lora_training_client(base_model="no/such-model", rank=2).result()


def test_a_wrong_or_missing_key_gets_401(served):
    for headers in ({}, {"X-API-Key": "tml-wrong"}, {"Authorization": "Bearer tml-wrong"}):
        r = httpx.post(f"{served.url}/api/v1/client/config", json={"sdk_version": "0.38.0"}, headers=headers)
        assert r.status_code == 401 and r.json() == {"detail": "invalid or missing API key"}
    ok = httpx.post(f"{served.url}/api/v1/client/config", json={}, headers={"Authorization": "Bearer tml-second-key"})
    assert ok.status_code == 200
    with pytest.raises(Exception):
        tinker.ServiceClient(base_url=served.url, api_key="tml-not-a-key").create_lora_training_client(
            base_model=str(served.policy), rank=2
        ).result()


def test_retries_are_deduplicated_and_chunks_run_in_seq_order(client, served):
    h = {"X-API-Key": API_KEY}
    post = lambda route, body: httpx.post(f"{served.url}/api/v1/{route}", json=body, headers=h, timeout=60)
    sid = post("create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}).json()["session_id"]
    created = post(
        "create_model",
        {"session_id": sid, "model_seq_id": 0, "base_model": str(served.policy), "lora_config": {"rank": 2}},
    )
    model_id = created.json()["model_id"]
    tokens = list(b"ordering")

    def fb(seq_id: int) -> dict:
        datum = {
            "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
            "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [len(tokens) - 1]}},
        }
        body = {
            "model_id": model_id,
            "seq_id": seq_id,
            "forward_backward_input": {"data": [datum], "loss_fn": "cross_entropy"},
        }
        return post("forward_backward", body).json()

    def result(request_id: str) -> dict:
        while True:
            r = post("retrieve_future", {"request_id": request_id}).json()
            if r.get("type") != "try_again":
                return r

    later = fb(3)  # held until 1 and 2 have run
    opt = post("optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}}).json()
    first = fb(1)
    assert fb(1)["request_id"] == first["request_id"]  # a retry of (model_id, 1): the same promise
    r1, r2, r3 = result(first["request_id"]), result(opt["request_id"]), result(later["request_id"])
    assert r2["metrics"]["grad_norm:mean"] > 0  # seq 1's gradient was there when the step ran
    assert r3["metrics"]["loss:sum"] < r1["metrics"]["loss:sum"]  # seq 3 ran after the step
    assert post("retrieve_future", {"request_id": "no-such-id"}).status_code == 410
