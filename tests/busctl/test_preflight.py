"""busctl up's name checks (:func:`busctl.preflight.check_names`): the nearest-name hint only for a name that is
not known."""

from __future__ import annotations

import pytest

from busctl.preflight import check_names
from configs.schema import ConfigError, load_config


def test_a_known_task_refused_for_another_reason_gets_no_did_you_mean() -> None:
    cfg = load_config(None, ["task.dataset.path=x.jsonl"])  # reverse_text generates its data
    with pytest.raises(ConfigError) as err:
        check_names(cfg)
    assert "task 'reverse_text' generates its examples and reads no files" in str(err.value)
    assert "did you mean" not in str(err.value)
    with pytest.raises(ConfigError, match="did you mean 'gsm8k'"):
        check_names(load_config(None, ["task.name=gsm9k"]))
