"""trackers.wandb_tracker.wandb_mode: W&B runs offline exactly when no API key is configured and
WANDB_MODE does not say otherwise (W&B itself reads WANDB_MODE and the key)."""

from __future__ import annotations

from pathlib import Path

from trackers.wandb_tracker import wandb_mode


def test_offline_without_a_key_and_wandb_mode_honoured(tmp_path: Path) -> None:
    no_netrc = {"NETRC": str(tmp_path / "absent")}
    assert wandb_mode(no_netrc) == "offline"
    assert wandb_mode({**no_netrc, "WANDB_MODE": "online"}) is None  # W&B applies it (and fails loudly without a key)
    assert wandb_mode({**no_netrc, "WANDB_MODE": "offline"}) is None
    assert wandb_mode({**no_netrc, "WANDB_API_KEY": "k" * 40}) is None


def test_a_netrc_login_for_the_wandb_host_counts_as_a_key(tmp_path: Path) -> None:
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert wandb_mode({"NETRC": str(netrc)}) is None
    assert wandb_mode({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.org"}) == "offline"  # another host
