"""Tests for trainer.losses.spec.LossSpec and its config mirror configs.schema.LossConfig: same
fields and defaults, the same bad values rejected by both, and `LossSpec.from_config`."""

import dataclasses
import math

import pytest

from configs.schema import LossConfig, load_config
from trainer.losses import LossSpec


def test_config_and_spec_have_the_same_fields_and_defaults():
    assert list(LossConfig.model_fields) == [f.name for f in dataclasses.fields(LossSpec)]
    assert LossSpec.from_config(LossConfig()) == LossSpec()


def test_from_config_carries_every_value():
    cfg = LossConfig(
        type="ppo_clip",
        adv_tau=0.5,
        eps_clip=0.1,
        eps_clip_high=0.28,
        eps_clip_c=3.0,
        icepop_beta=2.0,
        use_tis=True,
        tis_clip_low=0.5,
        tis_clip_high=4.0,
        kl_tau=0.01,
        kl_estimator="k2",
        kl_reference="reference",
        teacher_tau=0.3,
        aggregation="seq_mean_token_sum_norm",
    )
    spec = LossSpec.from_config(cfg)
    assert dataclasses.asdict(spec) == cfg.model_dump()
    assert spec.clip_high == 0.28 and LossSpec(eps_clip=0.1).clip_high == 0.1


def test_run_config_overrides_reach_the_spec():
    cfg = load_config(
        None,
        [
            "trainer.loss.type=gspo",
            "trainer.loss.eps_clip=0.0003",
            "trainer.loss.eps_clip_high=0.0004",
            "trainer.loss.aggregation=seq_mean_token_mean",
        ],
    )
    spec = LossSpec.from_config(cfg.trainer.loss)
    assert (spec.type, spec.eps_clip, spec.clip_high, spec.aggregation) == ("gspo", 3e-4, 4e-4, "seq_mean_token_mean")


BAD = [
    ({"type": "grpo"}, "type"),
    ({"adv_tau": -1.0}, "adv_tau"),
    ({"kl_tau": math.nan}, "kl_tau"),
    ({"teacher_tau": -0.1}, "teacher_tau"),
    ({"ratio_type": "segment"}, "ratio_type"),
    ({"token_mask_low": 1.5}, "token_mask_low"),
    ({"geo_mask_high": 0.5}, "geo_mask_high"),
    ({"sequence_mask_low": 1.5}, "sequence_mask_low"),
    ({"sequence_mask_high": 0.5}, "sequence_mask_high"),
    ({"sequence_clip_high": 0.5}, "sequence_clip_high"),
    ({"eps_clip": 0.0}, "eps_clip"),
    ({"eps_clip": 1.0}, "eps_clip"),
    ({"type": "ppo_clip", "eps_clip_high": -0.1}, "eps_clip_high"),
    ({"type": "ppo_clip", "eps_clip_c": 1.0}, "eps_clip_c"),
    ({"icepop_beta": 1.0}, "icepop_beta"),
    ({"icepop_beta": 0.5}, "icepop_beta"),
    ({"tis_clip_low": 1.5}, "tis_clip_low"),
    ({"tis_clip_high": 0.5}, "tis_clip_high"),
    ({"tis_clip_low": 1.0, "tis_clip_high": 1.0}, "tis_clip_low"),
    ({"kl_estimator": "k4"}, "kl_estimator"),
    ({"kl_reference": "teacher"}, "kl_reference"),
    ({"aggregation": "seq-mean-token-mean"}, "aggregation"),
    # options of one type set with another
    ({"type": "gspo", "eps_clip_c": 3.0}, "eps_clip_c"),
    ({"type": "ppo_clip", "ratio_type": "sequence"}, "ratio_type"),
    ({"type": "importance_sampling", "sequence_mask_high": 5.0}, "sequence_mask_high"),
]


@pytest.mark.parametrize("kwargs, field", BAD, ids=[str(k) for k, _ in BAD])
def test_spec_and_config_reject_the_same_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LossSpec(**kwargs)
    with pytest.raises(ValueError, match=field):  # pydantic's ValidationError is a ValueError
        LossConfig(**kwargs)


def test_good_edge_values_are_accepted_by_both():
    for kwargs in (
        {"token_mask_low": 0.0, "token_mask_high": 1.0},
        {"sequence_mask_low": 0.0, "sequence_mask_high": 1.0},
        {"tis_clip_low": 1.0, "tis_clip_high": 1.5},
        {"type": "ppo_clip", "eps_clip_c": 1.01},
        {"type": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4},
        {"icepop_beta": 1.5, "use_tis": True},
    ):
        assert LossSpec.from_config(LossConfig(**kwargs)) == LossSpec(**kwargs)
