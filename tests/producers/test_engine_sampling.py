"""Sampling parameters of RolloutEngine.generate_group with a real vLLM engine on CPU.

The model is the tiny random policy edited so that end-of-sequence (``<|im_end|>``) has
probability ~0.3-0.5 at every position: hidden dimension 0 of the residual stream is a constant
(every token embedding holds 3.0 there and no layer writes to it), and the lm_head row of EOS
reads only that dimension. So without ``min_tokens`` most samples stop within a few tokens, which
makes ``min_tokens`` observable. The engine runs with processed logprobs (post-temperature), as
the producers do, so a sample's logprobs must equal ``log_softmax(logits / T)`` of a HF forward.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytest.importorskip("vllm")

from producers.engine import RolloutEngine
from tests.producers.test_weight_sync import LOGPROB_ATOL, PROMPT, _hf_logprobs, _load_hf, assert_no_leftover_processes
from policies.tiny_model import IM_END_TOKEN_ID, build_random_policy

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

EOS_LOGIT = 5.0
"""Logit of EOS at every position (the others are ~N(0, 0.1)): p(EOS) ~ e^5 / (e^5 + 258) ~ 0.37."""


def _eos_prone(policy, out):
    """Save the policy at `policy` with EOS made likely everywhere (module docstring) to `out`."""
    from transformers import AutoTokenizer

    model = _load_hf(policy)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 3.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight[IM_END_TOKEN_ID, :] = 0.0
        # the final RMSNorm maps a residual stream dominated by dimension 0 to ~sqrt(hidden) there
        h0 = model.model.norm.weight[0].item() * model.config.hidden_size**0.5
        model.lm_head.weight[IM_END_TOKEN_ID, 0] = EOS_LOGIT / h0
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(policy).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(started RolloutEngine with processed logprobs, HF copy of its model, event loop)."""
    tmp = tmp_path_factory.mktemp("engine_sampling")
    model_dir = _eos_prone(build_random_policy(tmp / "policy", seed=0), tmp / "eos_prone")
    loop = asyncio.new_event_loop()
    eng = RolloutEngine(
        model_dir, max_model_len=128, kv_cache_bytes=32 * 1024**2, engine_kwargs={"logprobs_mode": "processed_logprobs"}
    )
    try:
        loop.run_until_complete(eng.start())
        yield eng, _load_hf(model_dir), loop
    finally:
        loop.run_until_complete(eng.close())
        loop.close()
        assert_no_leftover_processes()


def _generate(engine, request_id: str, **kwargs):
    eng, _, loop = engine
    params = dict(n=8, temperature=1.0, top_p=1.0, max_tokens=12) | kwargs
    return loop.run_until_complete(eng.generate_group(PROMPT, request_id=request_id, **params))


def test_eos_is_likely_without_min_tokens(engine):
    samples = _generate(engine, "no-min")
    lens = [len(s.token_ids) for s in samples]
    assert sum(n <= 4 for n in lens) >= 3, f"the edited model should stop early often: {lens}"
    for s in samples:
        if s.finish_reason == "stop":
            assert s.token_ids[-1] == IM_END_TOKEN_ID


def test_min_tokens_is_honoured(engine):
    min_tokens = 6
    samples = _generate(engine, "min", min_tokens=min_tokens)
    for s in samples:
        body = s.token_ids[:-1] if s.finish_reason == "stop" else s.token_ids
        assert IM_END_TOKEN_ID not in body[:min_tokens], s.token_ids
        assert len(body) >= min_tokens
        assert s.finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match="min_tokens"):
        _generate(engine, "bad", min_tokens=13)


def test_seed_makes_a_group_reproducible(engine):
    eng, _, loop = engine

    async def seeded_beside_other_requests(seed: int, tag: str):
        others = [
            asyncio.create_task(
                eng.generate_group(
                    PROMPT[:k], n=2, temperature=1.0, top_p=1.0, max_tokens=8, request_id=f"{tag}-other{k}"
                )
            )
            for k in (5, 9)
        ]
        group = await eng.generate_group(
            PROMPT, n=4, temperature=1.0, top_p=1.0, max_tokens=10, request_id=f"{tag}-seeded", seed=seed, min_tokens=3
        )
        await asyncio.gather(*others)
        return [s.token_ids for s in group]

    alone = _generate(engine, "seed-alone", n=4, max_tokens=10, seed=1234, min_tokens=3)
    batched = loop.run_until_complete(seeded_beside_other_requests(1234, "seed-batched"))
    assert [s.token_ids for s in alone] == batched
    assert len({tuple(t) for t in batched}) > 1, "the samples of one group must differ from each other"
    other_seed = loop.run_until_complete(seeded_beside_other_requests(4321, "seed-other"))
    assert other_seed != batched


def test_seeded_groups_whose_prompts_exceed_one_step_all_complete(engine):
    """32 seeded groups of 8 x 100 prompt tokens (25,600 > the 2,048 tokens of a step): with chunked prefill a
    seeded prompt split across steps killed the CPU engine ("CPU Generator does not use offset")."""
    eng, _, loop = engine

    async def many():
        return await asyncio.gather(
            *[
                eng.generate_group(
                    list(range(65, 165)), n=8, temperature=1.0, top_p=1.0, max_tokens=4, request_id=f"s{i}", seed=i
                )
                for i in range(32)
            ]
        )

    groups = loop.run_until_complete(many())
    assert [len(g) for g in groups] == [8] * 32


def test_without_detokenization_the_samples_are_the_same_and_carry_no_text(engine):
    with_text = _generate(engine, "detok", n=4, seed=99)
    without = _generate(engine, "no-detok", n=4, seed=99, detokenize=False)
    assert [s.token_ids for s in without] == [s.token_ids for s in with_text]
    assert [s.logprobs for s in without] == [s.logprobs for s in with_text]
    assert [s.text for s in without] == [""] * 4
    assert any(s.text for s in with_text)  # (the producer decodes the token ids with the HF tokenizer)
    # stop strings need the text: with `stop` the engine detokenizes whatever `detokenize` says
    stop = [next(s.text[1:3] for s in with_text if len(s.text) >= 3)]
    asked = _generate(engine, "stop-detok", n=4, seed=99, stop=stop)
    forced = _generate(engine, "stop-no-detok", n=4, seed=99, stop=stop, detokenize=False)
    assert [(s.token_ids, s.text, s.finish_reason) for s in forced] == [
        (s.token_ids, s.text, s.finish_reason) for s in asked
    ]
    assert any(s.finish_reason == "stop" and s.text for s in forced)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_processed_logprobs_follow_the_temperature(engine, temperature):
    _, model, _ = engine
    samples = _generate(engine, f"temp{temperature}", n=4, temperature=temperature, max_tokens=16, ignore_eos=True)
    for s in samples:
        ref = _hf_logprobs(model, PROMPT, s.token_ids, temperature=temperature)
        raw = _hf_logprobs(model, PROMPT, s.token_ids)
        got = torch.tensor(s.logprobs)
        assert (got - ref).abs().max().item() < LOGPROB_ATOL
        assert (got - raw).abs().max().item() > 0.05, "temperature made no difference: the check is void"


def test_repetition_penalty_changes_the_logprobs(engine):
    """A penalty lowers the logits of tokens already seen (vLLM's logprobs include it)."""
    _, model, _ = engine
    samples = _generate(engine, "rep", n=2, max_tokens=16, ignore_eos=True, repetition_penalty=1.5)
    worst = max(
        (torch.tensor(s.logprobs) - _hf_logprobs(model, PROMPT, s.token_ids)).abs().max().item() for s in samples
    )
    assert worst > 0.05


def test_eval_groups_finish_under_one_version_while_training_groups_span_the_update(engine, tmp_path):
    """The producer's pattern (producers.proc): eval generations hold EvalUpdateGate.eval_request,
    updates hold EvalUpdateGate.update. Runs last: it changes the engine's weights."""
    from broadcaster.filesystem import FilesystemSender
    from producers.eval_gate import EvalUpdateGate
    from tests.producers.test_weight_sync import _perturbed

    eng, model, loop = engine
    gate = EvalUpdateGate()
    version = eng.version + 1
    new = _perturbed(eng.model_path, seed=5)
    path = FilesystemSender(tmp_path / "weights").send(new.state_dict(), version)["path"]
    kwargs = dict(temperature=1.0, top_p=1.0, ignore_eos=True)

    async def eval_group():
        async with gate.eval_request():
            return await eng.generate_group(PROMPT, n=2, max_tokens=50, request_id="gate-eval", **kwargs)

    async def scenario():
        # the training group is twice as long: it is still running when the eval group ends
        training = asyncio.create_task(
            eng.generate_group(PROMPT, n=2, max_tokens=100, request_id="gate-train", **kwargs)
        )
        evaluation = asyncio.create_task(eval_group())
        await asyncio.sleep(0.01)
        assert not evaluation.done() and not training.done()
        async with gate.update():
            assert evaluation.done(), "the update must wait for the eval group"
            await eng.load_weights_from_path(version, path)
        return await evaluation, await training

    evaluation, training = loop.run_until_complete(scenario())
    assert {(s.version_start, s.version_end) for s in evaluation} == {(version - 1, version - 1)}
    for s in evaluation:
        assert (torch.tensor(s.logprobs) - _hf_logprobs(model, PROMPT, s.token_ids)).abs().max().item() < LOGPROB_ATOL
    # the training group started with the eval group and kept running across the update
    assert any(s.version_end == version and s.version_start == version - 1 for s in training), [
        s.version_spans for s in training
    ]
    # per-token versions: each token's logprob is that of the weights its version names (the
    # labels vLLM put on a partial rollout's tokens are exact at the update boundary)
    for s in training:
        versions = torch.tensor(s.token_versions)
        assert len(versions) == len(s.token_ids) and (versions.min(), versions.max()) == (
            s.version_start,
            s.version_end,
        )
        for v, weights in ((version - 1, model), (version, new)):
            err = (torch.tensor(s.logprobs) - _hf_logprobs(weights, PROMPT, s.token_ids))[versions == v].abs()
            assert len(err) == 0 or err.max().item() < LOGPROB_ATOL, (v, s.version_spans, err.max().item())


def test_idle_engine_processes_sleep_instead_of_spinning(engine):
    """After a group, vLLM's processes (on CPU the EngineCore, Worker inside; on GPU with tensor
    parallelism also Worker processes) must not busy-poll their queues (producers/vllm_idle.py caps vLLM's 1 s busy
    loop at the engine's busy_loop_s, 5 ms): over 2 s of idleness right after a read they use well under the ~2
    CPU-seconds that spinning costs."""
    import time

    import psutil

    _generate(engine, "idle-check")
    children = [p for p in psutil.Process().children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())]
    assert children, "the engine runs in child processes"

    def cpu_seconds() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in children)

    before = cpu_seconds()
    time.sleep(2.0)
    used = cpu_seconds() - before
    assert used < 0.5, f"vLLM's processes used {used:.2f} CPU-s while idle for 2 s (spinning readers?)"


def test_busy_loop_cap_parses_the_environment():
    from producers.vllm_idle import BUSY_LOOP_ENV, busy_loop_cap

    assert busy_loop_cap({}) is None
    assert busy_loop_cap({BUSY_LOOP_ENV: " "}) is None
    assert busy_loop_cap({BUSY_LOOP_ENV: "0.0"}) == 0.0
    assert busy_loop_cap({BUSY_LOOP_ENV: "0.25"}) == 0.25
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(ValueError, match=BUSY_LOOP_ENV):
            busy_loop_cap({BUSY_LOOP_ENV: bad})


def test_the_cpu_engine_is_one_process_with_the_worker_inside(engine):
    """On CPU the engine spawns only its EngineCore, which runs the Worker (producers/vllm_procs.py:
    one vLLM import less at start-up), and the caller's environment is left as it was."""
    import psutil

    from producers.engine import vllm_on_gpu
    from producers.vllm_procs import MULTIPROCESSING_ENV

    if vllm_on_gpu():
        pytest.skip("the CPU engine's process layout")
    _generate(engine, "one-process")
    children = [p for p in psutil.Process().children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(children) == 1, [p.cmdline() for p in children]
    assert MULTIPROCESSING_ENV not in os.environ


def test_engine_core_env_sets_and_restores_the_variables(monkeypatch):
    from producers.vllm_procs import MULTIPROCESSING_ENV, engine_core_env, engine_core_threads

    monkeypatch.delenv(MULTIPROCESSING_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    with engine_core_env(on_gpu=False):
        assert os.environ[MULTIPROCESSING_ENV] == "0" and os.environ["TORCH_COMPILE_DISABLE"] == "1"
        assert os.environ["OMP_NUM_THREADS"] == str(engine_core_threads()) != "0"
    assert not {MULTIPROCESSING_ENV, "OMP_NUM_THREADS", "TORCH_COMPILE_DISABLE"} & set(os.environ)
    with engine_core_env(on_gpu=False, eager=False):  # a compiled engine keeps torch.compile
        assert "TORCH_COMPILE_DISABLE" not in os.environ
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the caller's own thread count is kept
    monkeypatch.setenv(MULTIPROCESSING_ENV, "1")
    with engine_core_env(on_gpu=False):
        assert os.environ["OMP_NUM_THREADS"] == "3" and os.environ[MULTIPROCESSING_ENV] == "0"
    assert os.environ[MULTIPROCESSING_ENV] == "1"
    with engine_core_env(on_gpu=True):  # GPU: vLLM's own process layout
        assert os.environ[MULTIPROCESSING_ENV] == "1"
