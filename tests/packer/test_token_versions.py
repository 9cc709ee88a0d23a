"""Per-token policy versions from the producer to the micro-batch: a partial rollout's vLLM weight-
version spans (producers.engine) become the group's run-length spans (producers.proc), travel
through the codec and a real reward worker, and the packer expands them into
``MicroBatch.token_versions`` (and ``samples.jsonl`` shows them as spans)."""

from __future__ import annotations


from bus.codec import decode, encode
from bus.messages import Prompt
from packer.assemble import pack_groups
from packer.sample_log import sample_records
from producers.rollout_sample import Sample, token_versions
from producers.proc import group_from_samples
from rewards.worker import RewardWorker


def test_vllm_spans_become_per_token_versions():
    spans = ((3, 0, 2), (4, 2, 5))
    assert token_versions(spans, 5, default=3).tolist() == [3, 3, 4, 4, 4]
    # uncovered tokens (vLLM reported no span, or a span cut short by a stop string) get the default
    assert token_versions((), 3, default=7).tolist() == [7, 7, 7]
    assert token_versions(((5, 1, 9),), 3, default=4).tolist() == [4, 5, 5]


def test_partial_rollout_versions_reach_the_micro_batch():
    prompt = Prompt(id="p1", index=0, step=5, task="none", messages=[], info={})
    samples = [
        Sample([11, 12, 13, 14], [-0.1] * 4, "a", "stop", 3, 4, ((3, 0, 1), (4, 1, 4)), (3, 4, 4, 4)),
        Sample([], [], "", "length", 4, 4),  # no output token: no spans
        Sample([21, 22], [-0.2] * 2, "b", "stop", 4, 4, ((4, 0, 2),), (4, 4)),
        Sample([31], [-0.3], "c", "stop", 2, 2),  # a sender that knows no per-token versions
    ]
    group = decode(
        encode(group_from_samples(prompt, [1, 2, 3], samples, ["a", "", "b", "c"], producer="p", gen_time_s=0.1))
    )
    assert group.version_spans.tolist() == [[3, 1], [4, 3], [4, 2], [2, 1]]
    assert group.version_span_counts.tolist() == [2, 0, 1, 1]
    scored = decode(encode(RewardWorker({}, advantage="grpo", eps=1e-6, name="w", isolate=False).score(group)))
    assert [r["version_spans"] for r in sample_records(5, [scored], limit=4)] == [
        [[3, 1], [4, 3]],
        [],
        [[4, 2]],
        [[2, 1]],
    ]
    (mb,) = pack_groups([scored], 5, 64)
    mb = decode(encode(mb))
    assert mb.sample_ids == ["p1/0", "p1/1", "p1/2", "p1/3"]  # one group that fits: whole, in sample order
    assert (mb.step_loss_tokens, mb.step_samples) == (7, 3)
    # prompt tokens (3 per sample) carry the sample's oldest version
    assert mb.token_versions.tolist() == [3, 3, 3, 3, 4, 4, 4] + [4] * 3 + [4] * 5 + [2] * 4
    assert mb.oldest_versions.tolist() == [3, 4, 4, 2]
    lags = 5 - mb.token_versions[mb.loss_mask]
    assert sorted(lags.tolist()) == [1, 1, 1, 1, 1, 2, 3]
