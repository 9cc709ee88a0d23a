#!/usr/bin/env bash
# One prepared call for a lent GPU machine (the device tool's `run`), results under $OUT (at most 8 files
# come back). Default parts: issue 41's table, rlbus against TRL's GRPOTrainer step, about 7-8 minutes
# on an H100/H200 (estimated from run 3's part times; not yet measured):
#
#   on the CPU host, once:  make gpu-wheels && bash bench/gpu_session.sh --fetch-wheels
#   run(command="bash bench/gpu_session.sh", carry=[".whl"], timeout_s=600)
#
# PARTS (default: trl seq): trl seq, and issue 28's tests 16k 32k 8k profile compile, in the order given.
# .whl/*.whl: the wheels the device image lacks (pyzmq, pydantic and its three dependencies,
# typing_extensions: `make gpu-wheels`), always installed. .whl/bench/*.whl (--fetch-wheels): the bench
# extra (trl, liger-kernel) and trl.trainer.utils's imports an image may lack (datasets, pandas, ...),
# each installed only if python3 cannot import it already. Each part has its own time limit so one hang
# cannot eat the call; a failing part is reported and the next one runs. What it writes:
#   device.txt          GPU, driver, torch / transformers / triton / trl / liger versions, git commit
#   trainer_trl.json    bench.gpu_trainer --modes fixed: rlbus defaults against trl, trl_liger, trl_logits,
#                       the plain HF step; float32 master weights and +bf16 parameters (part trl)
#   trainer_seq.json    --modes sequence: 6 steps of new sample counts and lengths, with trainer.compile:
#                       tokens/s over the sequence, Dynamo graphs, peak allocated/reserved memory (part seq)
#   tests_gpu.log trainer_16k.json trainer_32k.json trainer_8k.json profile.txt trainer_compile.json: issue 28's
#   session.log         everything printed
set -u
BENCH_WHEELS="trl==1.16.0 liger-kernel==0.8.5 accelerate datasets pandas dill multiprocess xxhash psutil requests
urllib3 idna charset-normalizer certifi python-dateutil tzdata"
if [ "${1:-}" = --fetch-wheels ]; then  # on the CPU host: the lock's pins where it has the package
    mkdir -p .whl/bench
    for spec in $BENCH_WHEELS; do
        name=${spec%%==*}
        pin=$(grep -i "^$name==" requirements/cpu-test.txt | cut -d' ' -f1)
        .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl/bench "${pin:-$spec}" || exit 1
    done
    du -sh .whl .whl/bench
    exit 0
fi
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=/tmp/site:$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
fi
need=()
for w in .whl/bench/*.whl; do  # the bench wheels whose module the image lacks (find_spec: nothing imported)
    [ -e "$w" ] || continue
    dist=$(basename "$w" | cut -d- -f1)
    case $dist in python_dateutil) mod=dateutil ;; *) mod=$dist ;; esac
    python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('$mod') is None)" 2>/dev/null || need+=("$w")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "installing ${#need[@]} bench wheels: ${need[*]##*/}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${need[@]}" \
        || echo "bench wheel install failed: the baselines that need them say SKIPPED"
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
    python3 -c "from importlib.metadata import version as v; print('trl', v('trl'), 'liger-kernel', v('liger-kernel'))" \
        || echo "trl / liger-kernel: not installed"
    git rev-parse --short HEAD 2>/dev/null || echo "commit: unknown (no .git)"
} | tee "$OUT/device.txt"

part() {  # part NAME SECONDS COMMAND...: run with a time limit, report its status
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@"
    echo "== $name: exit $? in $((SECONDS - started)) s"
}

PARTS=${*:-trl seq}
echo "parts: $PARTS"
for p in $PARTS; do
    case $p in
    trl) part trainer_trl 240 python3 -m bench.gpu_trainer --modes fixed --steps 4 --micro-batch-tokens 16384 \
        --variants hf,trl,trl+bf16,trl_liger,trl_liger+bf16,trl_logits,default,default+bf16 --reference trl_liger \
        --out "$OUT/trainer_trl.json" ;;
    seq) part trainer_seq 270 python3 -m bench.gpu_trainer --modes sequence --sequence-steps 6 \
        --micro-batch-tokens 16384 --no-head-precision --reference trl_liger \
        --variants default,default+bf16,compile,compile+bf16,trl,trl_liger,trl_liger+bf16 --out "$OUT/trainer_seq.json" ;;
    tests) part tests_gpu 120 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/tests_gpu.log" ;;
    16k) part trainer_16k 150 python3 -m bench.gpu_trainer --steps 4 --micro-batch-tokens 16384 \
        --variants hf,default,no_share,head_bf16,ckpt --reference hf --out "$OUT/trainer_16k.json" ;;
    32k) part trainer_32k 90 python3 -m bench.gpu_trainer --steps 4 --micro-batch-tokens 32768 \
        --variants hf,default,head_bf16,ckpt --reference hf --out "$OUT/trainer_32k.json" ;;
    8k) part trainer_8k 90 python3 -m bench.gpu_trainer --steps 4 --micro-batch-tokens 8192 \
        --variants hf,default,no_share --reference hf --out "$OUT/trainer_8k.json" ;;
    profile) part profile 90 python3 -m bench.gpu_trainer --steps 1 --micro-batch-tokens 16384 \
        --variants default,trl_liger --profile --no-head-precision > "$OUT/profile.txt" 2>&1 ;;
    compile) part compile 240 python3 -m bench.gpu_trainer --steps 4 --micro-batch-tokens 32768 \
        --variants hf,default,compile,compile_head_bf16 --reference hf --out "$OUT/trainer_compile.json" ;;
    *) echo "unknown part $p" ;;
    esac
done
exit 0
