"""Config errors name their source (file and line, or override), the key, and the fix
(:mod:`configs.errors` through :func:`configs.schema.load_config`, on real YAML files)."""

from __future__ import annotations

import pytest

from configs.schema import ConfigError, load_config


def _error(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, list(overrides))
    return str(err.value)


def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrainer:\n  max_steps: [1\n  batch_size: 8\n")
    msg = _error(bad)
    assert f"config file {bad}, line 4, column 13" in msg, msg  # where PyYAML stopped
    assert "line 3, column 14" in msg and "not valid YAML" in msg and "fix the syntax" in msg  # where the [ began
    tab = tmp_path / "tab.yaml"
    tab.write_text("name: x\n\tbad: 1\n")
    assert f"config file {tab}, line 2" in _error(tab)


def test_override_value_that_is_not_yaml_names_the_override():
    msg = _error(None, ["trainer.max_steps=[1"])
    assert msg.startswith("override 'trainer.max_steps=[1': the value '[1' is not valid YAML at column 3"), msg
    assert "quote the value" in msg and "reverse_text.yaml" not in msg  # not blamed on the file


def test_override_without_equals_and_key_given_as_config_path():
    assert "write trainer.max_steps=VALUE" in _error(None, ["trainer.max_steps"])
    msg = _error("trainer.max_steps")  # what `busctl up trainer.max_steps` loads
    assert "if you meant an override, write it as trainer.max_steps=VALUE" in msg
    assert "empty parts" in _error(None, ["trainer..max_steps=3"])


def test_unknown_key_gets_the_nearest_known_key():
    msg = _error(None, ["trainer.max_step=3"])
    assert "trainer.max_step: unknown key (override 'trainer.max_step=3'); did you mean trainer.max_steps?" in msg
    assert "did you mean producers.group_size?" in _error(None, ["trainer.group_size=4"])  # a key in another section
    assert "remove it or check the spelling" in _error(None, ["zzzqqq=1"])  # nothing close


def test_bad_value_blamed_on_override_or_on_the_file_line(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("name: x\ntrainer:\n  max_steps: -3\n  optim:\n    lrr: 0.1\n")
    msg = _error(cfg, ["trainer.batch_size=0"])
    assert f"trainer.max_steps: Input should be greater than or equal to 1 (got -3; {cfg} line 3)" in msg, msg
    assert f"trainer.optim.lrr: unknown key ({cfg} line 5); did you mean trainer.optim.lr?" in msg
    assert (
        "trainer.batch_size: Input should be greater than or equal to 1 (got 0; override 'trainer.batch_size=0')" in msg
    )
    # a check over several keys names the file and the overrides that took part
    msg = _error(None, ["trainer.batch_size=20", "producers.group_size=8"])
    assert "with overrides 'trainer.batch_size=20', 'producers.group_size=8'" in msg and "Value error" not in msg
