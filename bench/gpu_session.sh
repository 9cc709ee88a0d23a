#!/usr/bin/env bash
# One prepared call for a lent GPU machine (the device tool's `run`): everything issue 28 measures,
# results under $OUT (at most 8 files come back). On an H200 (2026-11-28) the parts took: tests 31-43 s,
# 16k 93 s, 32k 68 s, compile 86 s; 8k and profile ran past 60 s (limits now 90). All parts together
# take about 7 minutes of the 10 a call may run; with a fresh machine's start, two calls of three
# parts each fit a 15-minute device budget with room for a rerun.
#
#   run(command="bash bench/gpu_session.sh [PART ...]", carry=[".whl"], timeout_s=600)
#
# PARTS (default: all, in this order): tests 16k 32k 8k profile compile.
# .whl holds the wheels the device image lacks (pyzmq, pydantic and its three dependencies,
# typing_extensions); fetch them once on the CPU host with `make gpu-wheels`. Each part has its own
# time limit so one hang cannot eat the call; a failing part is reported and the next one runs.
# What it writes:
#   device.txt          GPU, driver, torch / transformers / triton versions, git commit
#   tests_gpu.log       pytest -m gpu tests/gpu (the vLLM tests skip: vLLM cannot travel)
#   trainer_16k.json    bench.gpu_trainer, 16384-token micro-batches, variants below
#   trainer_32k.json    the same at 32768 tokens (one micro-batch for the uniform batch)
#   trainer_8k.json     the same at 8192 tokens
#   profile.txt         the top kernels of one default step (16384) per batch, and the kernels' busy share
#   trainer_compile.json  trainer.compile (Inductor) at 32768 tokens, against the defaults
#   session.log         everything printed
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
    git rev-parse --short HEAD 2>/dev/null || echo "commit: unknown (no .git)"
} | tee "$OUT/device.txt"

part() {  # part NAME SECONDS COMMAND...: run with a time limit, report its status
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@"
    echo "== $name: exit $? in $((SECONDS - started)) s"
}

selected() { [ "$PARTS" = all ] || [[ " $PARTS " == *" $1 "* ]]; }
PARTS=${*:-all}
echo "parts: $PARTS"
selected tests && part tests_gpu 120 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/tests_gpu.log"
selected 16k && part trainer_16k 150 python3 -m bench.gpu_trainer --steps 4 --micro-batch-tokens 16384 \
    --variants default,no_share,head_bf16,ckpt --out "$OUT/trainer_16k.json"
selected 32k && part trainer_32k 90 python3 -m bench.gpu_trainer --steps 4 --micro-batch-tokens 32768 \
    --variants default,head_bf16,ckpt --out "$OUT/trainer_32k.json"
selected 8k && part trainer_8k 90 python3 -m bench.gpu_trainer --steps 4 --micro-batch-tokens 8192 \
    --variants default,no_share --out "$OUT/trainer_8k.json"
selected profile && part profile 90 python3 -m bench.gpu_trainer --steps 1 --micro-batch-tokens 16384 --variants default \
    --profile > "$OUT/profile.txt" 2>&1
selected compile && part compile 240 python3 -m bench.gpu_trainer --steps 4 --micro-batch-tokens 32768 \
    --variants default,compile,compile_head_bf16 --out "$OUT/trainer_compile.json"
exit 0
