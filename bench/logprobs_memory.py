"""Peak memory and time of token logprobs + entropy: naive full logits vs the chunked path.

For hidden states `[T, H]` and an LM head `[V, H]`, both paths compute each target token's logprob (with the
backward) and each position's entropy: naive as one `[T, V]` float32 logits tensor, chunked through
`trainer.forward.logprobs.linear_logprobs_and_entropy` ("torch" backend; also "triton" on CUDA).

    .venv/bin/python -m bench.logprobs_memory                       # the table in bench/README.md
    python -m bench.logprobs_memory --device cuda --dtype bfloat16 --configs 32768x8192,151936x8192

CPU: each (config, path) in a fresh subprocess, peak RSS above the pre-run RSS (`/proc/self/clear_refs` and
`VmHWM`; else `ru_maxrss`). CUDA: in-process `max_memory_allocated` and event times, chunked results checked
against naive. A naive run whose estimated peak (4 x T x V float32) exceeds `--max-naive-gib` is not run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from trainer.forward.logprobs import DEFAULT_CHUNK_SIZE, linear_logprobs_and_entropy

GIB = 1024**3
MIB = 1024**2


def naive_logprobs_and_entropy(hidden, weight, targets, temperature):
    """Full `[T, V]` float32 logits -> log_softmax -> gather; entropy -sum p log p without grad."""
    logits = torch.nn.functional.linear(hidden, weight).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    logprob = logp.gather(1, targets[:, None]).squeeze(1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return logprob, entropy


def run_path(path, hidden, weight, targets, chunk_size):
    """One forward + backward of `path` ("naive", "torch", "triton"); returns (logprob, entropy) detached."""
    if path == "naive":
        logprob, entropy = naive_logprobs_and_entropy(hidden, weight, targets, 1.0)
    else:
        logprob, entropy = linear_logprobs_and_entropy(
            hidden, weight, None, targets, temperature=1.0, chunk_size=chunk_size, backend=path
        )
    logprob.sum().backward()
    return logprob.detach(), entropy


def naive_estimate_bytes(vocab: int, tokens: int) -> int:
    """Estimated naive peak: logits, log-softmax (saved), its gradient and one temporary, all [T, V] fp32."""
    return 4 * tokens * vocab * 4


def make_inputs(vocab, tokens, hidden_size, dtype, device, seed=0):
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator, device=device, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=generator, device=device, dtype=dtype)
    weight = weight.div_(hidden_size**0.5).requires_grad_()  # in place: no transient second copy
    targets = torch.randint(0, vocab, (tokens,), generator=generator, device=device)
    return hidden, weight, targets


def cpu_worker(args) -> None:
    """Runs in a fresh process: print {"peak_mib", "seconds"} of one forward + backward."""
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    run_path(args.worker, *make_inputs(64, 16, args.hidden, dtype, "cpu"), 4)  # load code pages and thread pools
    hidden, weight, targets = make_inputs(args.vocab, args.tokens, args.hidden, dtype, "cpu")
    exact = reset_peak_rss()
    before_kib = proc_status_kib("VmRSS") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    run_path(args.worker, hidden, weight, targets, args.chunk_size)
    seconds = time.perf_counter() - start
    peak_kib = proc_status_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mib": (peak_kib - before_kib) / 1024, "seconds": seconds, "exact_peak": exact}))


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS mark to its current RSS (Linux: proc(5), /proc/pid/clear_refs "5")."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def proc_status_kib(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS: resident now, VmHWM: peak resident)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise ValueError(f"{field} not in /proc/self/status")


def cpu_bench(args, configs) -> list[dict]:
    rows = []
    for vocab, tokens in configs:
        row = {"vocab": vocab, "tokens": tokens, "logits_mib": tokens * vocab * 4 / MIB}
        for path in ("naive", "torch"):
            if path == "naive" and naive_estimate_bytes(vocab, tokens) > args.max_naive_gib * GIB:
                row[path] = None
                continue
            cmd = [
                sys.executable,
                "-m",
                "bench.logprobs_memory",
                "--worker",
                path,
                "--vocab",
                str(vocab),
                "--tokens",
                str(tokens),
                "--hidden",
                str(args.hidden),
                "--chunk-size",
                str(args.chunk_size),
                "--threads",
                str(args.threads),
                "--dtype",
                args.dtype,
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            row[path] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"  {vocab}x{tokens} {path}: {row[path]}", file=sys.stderr)
        rows.append(row)
    return rows


def cuda_bench(args, configs) -> list[dict]:
    """In-process CUDA measures: peak allocated above the inputs, median time, max error vs naive."""
    rows = []
    dtype = getattr(torch, args.dtype)
    for vocab, tokens in configs:
        row = {"vocab": vocab, "tokens": tokens, "logits_mib": tokens * vocab * 4 / MIB}
        reference = None
        for path in ("naive", "torch", "triton"):
            if path == "naive" and naive_estimate_bytes(vocab, tokens) > args.max_naive_gib * GIB:
                row[path] = None
                continue
            hidden, weight, targets = make_inputs(vocab, tokens, args.hidden, dtype, "cuda")
            run_path(path, hidden, weight, targets, args.chunk_size)  # warm-up (kernel compile, cuBLAS)
            times = []
            for _ in range(args.repeats):
                hidden.grad = weight.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                logprob, entropy = run_path(path, hidden, weight, targets, args.chunk_size)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1000)
                peak_mib = (torch.cuda.max_memory_allocated() - base) / MIB
            result = {"peak_mib": peak_mib, "seconds": statistics.median(times)}
            if path == "naive":
                reference = (logprob, entropy, hidden.grad.float(), weight.grad.float())
            elif reference is not None:
                got = (logprob, entropy, hidden.grad.float(), weight.grad.float())
                result["max_abs_err"] = max(float((a - b).abs().max()) for a, b in zip(got, reference))
            row[path] = result
            print(f"  {vocab}x{tokens} {path}: {result}", file=sys.stderr)
            del hidden, weight, targets, logprob, entropy
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def markdown(rows, paths) -> str:
    chunked_paths = [p for p in paths if p != "naive"]
    head = "| V | T | [T,V] fp32 | " + " | ".join(f"{p} peak | {p} time" for p in paths)
    head += "".join(f" | {p}/naive peak" for p in chunked_paths)
    lines = [head + " |", "|" + "---|" * (3 + 2 * len(paths) + len(chunked_paths))]
    for row in rows:
        cells = [f"{row['vocab']}", f"{row['tokens']}", f"{row['logits_mib']:,.0f} MiB"]
        for path in paths:
            value = row.get(path)
            if value is None:
                cells += ["not run", ""]
            else:
                cells += [f"{value['peak_mib']:,.0f} MiB", f"{value['seconds']:.2f} s"]
        naive = row.get("naive")
        for path in chunked_paths:
            chunked = row.get(path)
            cells.append(f"{chunked['peak_mib'] / naive['peak_mib']:.3f}" if naive and chunked else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_configs(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(x) for x in item.split("x")) for item in text.split(",")]
    except ValueError as error:
        raise ValueError(f"--configs must be VOCABxTOKENS[,VOCABxTOKENS...], got {text!r}") from error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="32768x8192,32768x16384,151936x4096,151936x8192", help="VOCABxTOKENS,...")
    parser.add_argument("--hidden", type=int, default=896, help="hidden size H (Qwen2.5-0.5B: 896)")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats on CUDA")
    parser.add_argument("--max-naive-gib", type=float, default=12.0, help="skip naive runs estimated above this")
    parser.add_argument("--worker", choices=["naive", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        cpu_worker(args)
        return
    configs = parse_configs(args.configs)
    if args.device == "cuda":
        print(markdown(cuda_bench(args, configs), ("naive", "torch", "triton")))
    else:
        print(markdown(cpu_bench(args, configs), ("naive", "torch")))


if __name__ == "__main__":
    main()
