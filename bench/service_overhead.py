"""What ``busctl serve`` costs over running the same trainer code in-process: forward_backward + optim_step of one
batch through the official Tinker SDK (HTTP, futures, the bus, the trainer process) against the same calls on
:class:`trainer.api.engine.ApiEngine` in this process (the same model, LoRA, batch and losses: only the API and
the bus differ). Prints one markdown row per batch shape; method and results in bench/README.md.

    python -m bench.service_overhead [--steps 6] [--datums 16] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

KEY = "tml-bench"


def batch(datums: int, tokens: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, tokens + 1).tolist() for _ in range(datums)]


def through_api(url: str, policy: str, seqs: list[list[int]], steps: int) -> list[float]:
    import tinker
    from tinker import types

    tc = tinker.ServiceClient(base_url=url, api_key=KEY).create_lora_training_client(policy, rank=8, seed=0).result()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": np.array(s[1:], dtype=np.int64)},
        )
        for s in seqs
    ]
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()
        times.append(time.perf_counter() - t)
    return times


def in_process(run_dir: Path, policy: str, seqs: list[list[int]], steps: int) -> list[float]:
    import torch

    from bus.messages_api import ApiCall
    from configs.schema import load_config
    from trainer.api.engine import ApiEngine

    cfg = load_config(None, [f"model.path={policy}", f"run_dir={run_dir}"])
    if cfg.trainer.num_threads:  # as the serve trainer does (trainer/api/proc.py)
        torch.set_num_threads(cfg.trainer.num_threads)
    engine = ApiEngine(cfg, run_dir)
    call = lambda op, body, **arrays: engine.handle(
        ApiCall(
            id=f"{op}-{time.perf_counter_ns()}",
            op=op,
            model_id="m",
            body=body,
            **arrays,
        )
    )
    assert call("create_model", {"base_model": policy, "lora": {"rank": 8, "seed": 0}}).ok
    ids = np.concatenate([s[:-1] for s in seqs]).astype(np.int64)
    targets = np.concatenate([s[1:] for s in seqs]).astype(np.float64)[None]
    lens = np.array([len(s) - 1 for s in seqs], dtype=np.int64)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fb = call(
            "forward_backward",
            {"loss_fn": "cross_entropy", "loss_inputs": ["target_tokens"]},
            token_ids=ids,
            datum_lens=lens,
            loss_inputs=targets,
        )
        opt = call("optim_step", {"adam_params": {"learning_rate": 1e-4}})
        assert fb.ok and opt.ok, (fb.error, opt.error)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--datums", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    from policies.tiny_model import build_random_policy

    tmp = Path(tempfile.mkdtemp(prefix="rlbus-serve-bench-"))
    policy = str(build_random_policy(tmp / "tiny", seed=0))
    seqs = batch(args.datums, args.tokens)
    cmd = [
        sys.executable,
        "-m",
        "busctl",
        "serve",
        f"run_dir={tmp / 'run'}",
        f"model.path={policy}",
        "serve.port=0",
        "serve.samplers=0",
    ]
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "RLBUS_SERVE_API_KEYS": KEY},
    )
    try:
        while "components ready" not in (tmp / "serve.log").read_text():
            if proc.poll() is not None:
                raise SystemExit((tmp / "serve.log").read_text())
            time.sleep(0.5)
        url = json.loads((tmp / "run" / "serve.json").read_text())["url"]
        api = through_api(url, policy, seqs, args.steps)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    local = in_process(tmp / "local", policy, seqs, args.steps)
    a, b = float(np.median(api[1:])), float(np.median(local[1:]))  # the first step warms up
    print("| datums x tokens | API step (s) | in-process step (s) | in-process / API |")
    print("|---|---|---|---|")
    print(f"| {args.datums} x {args.tokens} | {a:.3f} | {b:.3f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
