#!/bin/bash
# Issue 36's GPU figures in one lease of a GPU machine, most important first, each bench under
# its own time limit inside one overall deadline, so that one that hangs costs only its share.
#
#   bash bench/gpu_issue36.sh            # on the GPU machine (results under $OUT, or bench/out-gpu)
#   SMOKE=1 bash bench/gpu_issue36.sh    # the same commands on a CPU machine, tiny sizes
#
# The GPU image of our lender has torch and transformers but not Ray or DeepSpeed: where
# .whl/site.tar.xz exists (a site-packages folder: Ray 2.60 trimmed of Java, the dashboard's
# web client, RLlib and Serve; DeepSpeed; FAISS; their missing dependencies), it is unpacked
# first and put on PYTHONPATH. It was built on a CPU machine: `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 ...` of ray==2.60.0,
# faiss-cpu, pydantic, pydantic_core, annotated-types, typing-inspection, jsonschema,
# jsonschema-specifications, referencing, rpds-py, tensorboardX, hjson, bm25s, ir_measures,
# pytrec_eval-terrier and nvidia-ml-py, each unzipped into one folder, with deepspeed and
# colorful copied from the CPU venv (pure Python), then ray/jars, ray/dashboard/client/build,
# ray/rllib, ray/serve and ray/llm removed (the tree that travels is capped at 64 MiB), and
# `tar -cJf .whl/site.tar.xz` of the folder (.whl/ is in .git/info/exclude).
set -u
OUT=${OUT:-bench/out-gpu}
mkdir -p "$OUT"
LOG="$OUT/all.log"
BUDGET=${BUDGET:-540}
deadline=$((SECONDS + BUDGET))
PY=${PY:-python3}
if ! $PY -c "import ray, deepspeed" 2>/dev/null && [ -f .whl/site.tar.xz ]; then
    [ -d /tmp/site/ray ] || { mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/site.tar.xz; }
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    nproc
    $PY -c "import sys, torch, transformers, ray, deepspeed, faiss; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, ray.__version__, deepspeed.__version__, faiss.__version__)" 2>&1
} > "$OUT/env.txt"
cat "$OUT/env.txt" >> "$LOG"

step() {  # step NAME SECONDS COMMAND...: runs within both its own limit and the deadline
    local name=$1 limit=$2 left=$((deadline - SECONDS))
    shift 2
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 30 ]; then
        echo "== $name skipped: ${left}s left" | tee -a "$LOG"
        return
    fi
    echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" >> "$LOG" 2>&1
    echo "== $name rc=$? in $((SECONDS - start))s" | tee -a "$LOG"
}

if [ "${SMOKE:-0}" = 1 ]; then
    mfu=(--size tiny --gpus 0 --steps 20 --precision fp32 --micro_batch 16 --cpus_per_worker 2)
    step mfu_compiled 400 $PY bench/bench_pretrain_mfu.py "${mfu[@]}" --compile --json "$OUT/mfu_compiled.json"
    step methods 200 $PY bench/bench_methods_gpu.py --tiny --device cpu --free_gib 0.01 \
        --methods cocondenser,cocondenser-gradcache-sized --json "$OUT/methods.json"
    step encode 300 $PY bench/bench_retrieval_gpu.py --parts encode --devices cpu --cpu-passages 300 \
        --encode-runs minilm:cpu:fp32:64,minilm:cpu:fp32:64:compiled --json "$OUT/encode.json"
    exit 0
fi

# BERT-base Condenser through jobs/pretrain.py: 512 rows a step (the job runs them as one
# micro-batch where memory holds it), eager then compiled; then 128 rows, as the bare
# bench_methods_gpu.py rows of 2026-11-22 were measured.
mfu=(--size bert-base --gpus 1 --steps 50 --cpus_per_worker 8)
step mfu_512 120 $PY bench/bench_pretrain_mfu.py "${mfu[@]}" --grad_accum 4 --json "$OUT/mfu_512.json"
step mfu_512_compiled 170 $PY bench/bench_pretrain_mfu.py "${mfu[@]}" --grad_accum 4 --compile --json "$OUT/mfu_512_compiled.json"
# Encoding BERT-base (and MiniLM) over Nave's 37k verses through the encoder pool.
step encode 130 $PY bench/bench_retrieval_gpu.py --parts encode --cpu-passages 0 --encode-runs \
    bert-base:gpu:fp16:256,bert-base:gpu:fp16:1024,bert-base:gpu:bf16:1024,bert-base:gpu:fp16:1024:compiled,minilm:gpu:fp32:1024,minilm:gpu:fp16:1024 \
    --json "$OUT/encode.json"
# coCondenser without the cache (128 sequences) against the cache at a memory-sized chunk
# (1,024 sequences): issue 36's "within 1.3x".
step methods 80 $PY bench/bench_methods_gpu.py --sizes bert-base --steps 10 \
    --methods cocondenser,cocondenser-gradcache-sized --json "$OUT/methods.json"
step mfu_128 100 $PY bench/bench_pretrain_mfu.py "${mfu[@]}" --json "$OUT/mfu_128.json"
echo "== done in ${SECONDS}s" | tee -a "$LOG"
