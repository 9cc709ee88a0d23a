"""What sampling through ``busctl serve`` costs over the producer's engine used directly: the same work (N
reverse_text prompts x G completions of at most T tokens, temperature 1, optionally a fixed seed per prompt) through the
official Tinker SDK (``create_sampling_client`` + ``sample``, all futures issued before the first result is read,
as a client does) against ``asyncio.gather`` of the same requests on a :class:`producers.engine.RolloutEngine`
built by ``producers.engines.build_engine`` from the same config in a process of its own (the sampler component's
engine and settings: only the API, the bus and the sampler's process differ). Both stay up; repetitions alternate
the arms and the medians are printed as one markdown row. Method and results in bench/README.md.

    python -m bench.service_sampling_overhead [--reps 5] [--prompts 32] [--samples 8] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
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


def prompts(model: str, n: int) -> list[list[int]]:
    """``n`` reverse_text prompts rendered with the policy's chat template, as token ids."""
    from transformers import AutoTokenizer

    from tasks.reverse_text import reverse_text_examples

    tok = AutoTokenizer.from_pretrained(model)
    out = []
    for ex in reverse_text_examples("train", n, seed=0):
        text = tok.apply_chat_template(
            [{"role": "user", "content": ex["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        out.append(tok.encode(text, add_special_tokens=False))
    return out


async def one_rep(engine, job: dict) -> list:
    """Every prompt's group on ``engine`` at once (as the sampler receives the API's calls)."""
    return await asyncio.gather(
        *(
            engine.generate_group(
                p,
                n=job["samples"],
                temperature=1.0,
                top_p=1.0,
                max_tokens=job["tokens"],
                seed=None if job["seed"] is None else job["seed"] + i,
                request_id=f"r{job['rep']}-{i}",
                detokenize=False,
            )
            for i, p in enumerate(job["prompts"])
        )
    )


def worker(model: str, run_dir: str) -> None:
    """The direct arm's process: the sampler's engine; one repetition per ``go`` line on stdin."""
    from configs.schema import load_config
    from producers.engines import build_engine

    cfg = load_config(None, [f"model.path={model}", f"run_dir={run_dir}", "serve.only=true"])
    engine = build_engine(cfg, 0, "producer-0")
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    print("READY", flush=True)
    try:
        for line in sys.stdin:
            job = json.loads(line)
            t = time.perf_counter()
            groups = loop.run_until_complete(one_rep(engine, job))
            dt = time.perf_counter() - t
            toks = sum(len(s.token_ids) for g in groups for s in g)
            print("RESULT " + json.dumps({"s": dt, "samples": sum(map(len, groups)), "tokens": toks}), flush=True)
    finally:
        loop.run_until_complete(engine.close())


def through_api(sampler, job: dict) -> dict:
    from tinker import types

    t = time.perf_counter()
    futures = [
        sampler.sample(
            types.ModelInput.from_ints(p),
            job["samples"],
            types.SamplingParams(
                max_tokens=job["tokens"], temperature=1.0, seed=None if job["seed"] is None else job["seed"] + i
            ),
        )
        for i, p in enumerate(job["prompts"])
    ]
    seqs = [s for f in futures for s in f.result().sequences]
    return {"s": time.perf_counter() - t, "samples": len(seqs), "tokens": sum(len(s.tokens) for s in seqs)}


def direct(proc: subprocess.Popen, job: dict) -> dict:
    proc.stdin.write(json.dumps(job) + "\n")
    proc.stdin.flush()
    while not (line := proc.stdout.readline()).startswith("RESULT "):
        if not line:
            raise SystemExit("the direct engine's process ended")
    return json.loads(line[7:])


def wait_for(path: Path, text: str, proc: subprocess.Popen) -> None:
    while text not in path.read_text():
        if proc.poll() is not None:
            raise SystemExit(path.read_text()[-4000:])
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per arm (after one warm-up each)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt (num_samples)")
    parser.add_argument("--tokens", type=int, default=32, help="max_tokens")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="prompt i samples with seed + i (identical work in both arms); vLLM 0.32 on CPU kills the engine when a "
        "seeded request's prefill is chunked (> 2048 tokens in a step: 'CPU Generator does not use offset')",
    )
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "RUN_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    from configs.schema import load_config
    from policies.tiny_model import ensure_policy

    m = load_config(None, []).model
    model = str(ensure_policy(Path(m.cache_dir), sft_steps=m.sft_steps, sft_target_loss=m.sft_target_loss).resolve())
    tmp = Path(tempfile.mkdtemp(prefix="rlbus-sample-bench-"))
    serve_cmd = [sys.executable, "-m", "busctl", "serve", f"run_dir={tmp / 'run'}", f"model.path={model}"]
    serve_log, direct_log = tmp / "serve.log", tmp / "direct.log"
    env = {**os.environ, "RLBUS_SERVE_API_KEYS": KEY}
    procs = []
    try:
        serve = subprocess.Popen(
            [*serve_cmd, "serve.port=0"], stdout=open(serve_log, "w"), stderr=subprocess.STDOUT,
            start_new_session=True, env=env,
        )  # fmt: skip
        procs.append(serve)
        wait_for(serve_log, "components ready", serve)
        eng = subprocess.Popen(
            [sys.executable, "-m", "bench.service_sampling_overhead", "--worker", model, str(tmp / "direct")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(direct_log, "w"), text=True,
            start_new_session=True,
        )  # fmt: skip
        procs.append(eng)
        while (line := eng.stdout.readline()) != "READY\n":
            if not line:
                raise SystemExit(direct_log.read_text()[-4000:])
        import tinker

        url = json.loads((tmp / "run" / "serve.json").read_text())["url"]
        sampler = tinker.ServiceClient(base_url=url, api_key=KEY).create_sampling_client(base_model=model).result()
        ps = prompts(model, args.prompts)
        rows: dict[str, list[dict]] = {"api": [], "direct": []}
        for rep in range(args.reps + 1):  # rep 0 warms both up; the arm that goes first alternates
            job = {"prompts": ps, "samples": args.samples, "tokens": args.tokens, "seed": args.seed, "rep": rep}
            order = ["api", "direct"] if rep % 2 == 0 else ["direct", "api"]
            for arm in order:
                r = through_api(sampler, job) if arm == "api" else direct(eng, job)
                print(f"rep {rep} {arm}: {r['s']:.2f} s, {r['samples']} samples, {r['tokens']} tokens", flush=True)
                if rep:
                    rows[arm].append(r)
    finally:
        for p in reversed(procs):
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=60)
    api = np.array([r["samples"] / r["s"] for r in rows["api"]])
    dirx = np.array([r["samples"] / r["s"] for r in rows["direct"]])
    tok_a = np.median([r["tokens"] / r["s"] for r in rows["api"]])
    tok_d = np.median([r["tokens"] / r["s"] for r in rows["direct"]])
    print("| prompts x samples x max_tokens | API samples/s (tokens/s) | direct samples/s (tokens/s) | API / direct |")
    print("|---|---|---|---|")
    print(
        f"| {args.prompts} x {args.samples} x {args.tokens} | {np.median(api):.1f} ({tok_a:.0f}) "
        f"| {np.median(dirx):.1f} ({tok_d:.0f}) | {np.median(api / dirx):.2f}x (pairs: "
        + ", ".join(f"{x:.2f}" for x in api / dirx)
        + ") |"
    )


if __name__ == "__main__":
    main()
