#!/bin/bash
# The GPU benchmarks in one lease of a GPU machine, most important first, each bench under
# its own time limit inside one overall deadline, so that one that hangs costs only its share.
#
#   bash bench/gpu_lease.sh            # on the GPU machine (results under $OUT, or bench/out-gpu)
#   SMOKE=1 bash bench/gpu_lease.sh    # the same commands on a CPU machine, tiny sizes
#
# All steps take ~700 s with start-up, more than one call's 600: a 15-minute lease runs them
# as two calls on the warm machine, each within its own BUDGET:
#   STEPS=mfu_512,bare_512,mfu_512_profiled BUDGET=380 bash bench/gpu_lease.sh
#   STEPS=encode_128,gradcache,mfu_512_compiled BUDGET=330 bash bench/gpu_lease.sh
#
# The GPU image of our lender has torch and transformers but not Ray or DeepSpeed: where
# .whl/site.tar.xz exists (a site-packages folder: Ray 2.60 trimmed of Java, the dashboard's
# web client, RLlib and Serve; DeepSpeed; FAISS; their missing dependencies), it is unpacked
# first and put on PYTHONPATH. It was built on a CPU machine: `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --platform
# manylinux_2_28_x86_64 ...`, each at the CPU venv's version (`pip list --format=freeze`: a
# pydantic_core one release off stops pydantic, hence DeepSpeed, at import), of ray==2.60.0,
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
    site=/tmp/site-$(cksum < .whl/site.tar.xz | cut -d' ' -f1)  # a warm machine may hold an older one
    [ -d "$site/ray" ] || { mkdir -p "$site" && tar -C "$site" -xJf .whl/site.tar.xz; }
    export PYTHONPATH=$site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    nproc
    $PY -c "import sys, torch, transformers, ray, deepspeed, faiss; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, ray.__version__, deepspeed.__version__, faiss.__version__)" 2>&1
} >> "$LOG"  # no file of its own: the lender returns at most 8

step() {  # step NAME SECONDS COMMAND...: runs within both its own limit and the deadline
    local name=$1 limit=$2 left=$((deadline - SECONDS))
    shift 2
    if [ -n "${STEPS:-}" ] && [[ ",$STEPS," != *",$name,"* ]]; then
        return  # STEPS=a,b runs only those: a lease split over two calls
    fi
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

# Profiles are bundled into one file at the end: the lender returns at most 8 files, named
# in letters, digits, '.', '_' and '-' alone.
PROFILES=$(mktemp -d)
trap 'tar -C "$PROFILES" -czf "$OUT/profiles.tar.gz" . 2>/dev/null' EXIT
if [ "${SMOKE:-0}" = 1 ]; then
    mfu=(--size tiny --gpus 0 --steps 20 --precision bf16 --micro_batch 16 --grad_accum 2 --cpus_per_worker 2)
    step mfu_512 300 $PY bench/bench_pretrain_mfu.py "${mfu[@]}" --json "$OUT/mfu_512.json"
    step bare_512 300 $PY bench/bench_methods_gpu.py --tiny --device cpu --methods condenser \
        --variants held,held+unpadded,held+blocks+auto --json "$OUT/bare_512.json" --profile "$PROFILES/profile"
    step encode_128 300 $PY bench/bench_retrieval_gpu.py --parts encode --devices cpu --cpu-passages 300 --min-words 130 \
        --encode-runs minilm:cpu:fp32:64 --json "$OUT/encode_128.json" --profile "$PROFILES/profile-encode.txt"
    step gradcache 300 $PY bench/bench_methods_gpu.py --tiny --device cpu --free_gib 0.05 \
        --methods cocondenser-sized-batch,cocondenser-gradcache-sized --json "$OUT/gradcache.json"
    step mfu_512_profiled 300 $PY bench/bench_pretrain_mfu.py "${mfu[@]}" --json "$OUT/mfu_512_profiled.json" \
        --profile "$PROFILES/profile-job.txt"
    step mfu_512_compiled 400 $PY bench/bench_pretrain_mfu.py "${mfu[@]}" --compile --json "$OUT/mfu_512_compiled.json"
    exit 0
fi

mfu=(--size bert-base --gpus 1 --steps 50 --cpus_per_worker 8 --grad_accum 4)
# The job at 512 rows a step, run as one micro-batch, eager. Two changes since the last lease
# (0.207 MFU, 0.72 of the bare step held in bf16) are in it: one bf16 worker runs DeepSpeed's
# BF16_Optimizer (stage 1, fp32 gradient accumulation) instead of stage 0's
# FP16_UnfusedOptimizer, whose overflow check synced the host once per parameter tensor; and
# the MLM projection runs on the vocabulary padded to 30,528 rows (models.backbone.VOCAB_MULTIPLE).
step mfu_512 140 $PY bench/bench_pretrain_mfu.py "${mfu[@]}" --json "$OUT/mfu_512.json"
# The bare step beside it, held in bf16 as DeepSpeed holds it, with the padded vocabulary and
# without (the 30,522-wide products ran on Ampere kernels at ~236 TFLOP/s): the job's ratio
# to the model's own step, what the padding gains, and the compiled step's profile (compiling
# gained 2%: why is not known).
step bare_512 130 env TORCHINDUCTOR_COALESCE_TILING_ANALYSIS=0 $PY bench/bench_methods_gpu.py --sizes bert-base \
    --batch 512 --steps 10 --methods condenser --variants held,held+unpadded,held+blocks+auto \
    --json "$OUT/bare_512.json" --profile "$PROFILES/profile"
# The eager job again, 16 steps, its steps 11-13 profiled where they run (what is left
# between the job and the bare step; no lease has brought this profile back yet). Its rate
# is not the job's: the profiler's export slows the steps after it.
step mfu_512_profiled 110 $PY bench/bench_pretrain_mfu.py "${mfu[@]}" --steps 16 --json "$OUT/mfu_512_profiled.json" \
    --profile "$PROFILES/profile-job.txt"
# Encoding at the full 128 tokens a row (10,938 passages/s on the last lease, 15,000 asked),
# now with the next batch framed and queued while the GPU runs the one before; eager, then
# compiled (rows of one width: one graph). The eager encoder also runs in this process
# without the pool, profiled: a hand count puts its kernels near 50 ms a batch of 1,024,
# the last lease's device rate was 88 ms.
step encode_128 150 $PY bench/bench_retrieval_gpu.py --parts encode --cpu-passages 0 --min-words 130 \
    --encode-runs bert-base:gpu:fp16:4096,bert-base:gpu:fp16:4096:compiled --json "$OUT/encode_128.json" \
    --profile "$PROFILES/profile-encode.txt"
# coCondenser's gradient cache at the chunk sized from free memory against the same batch
# (8 x 128 spans of 126 tokens) in one graph without it, where memory holds that.
step gradcache 150 $PY bench/bench_methods_gpu.py --sizes bert-base --methods \
    cocondenser-sized-batch,cocondenser-gradcache-sized --json "$OUT/gradcache.json"
# Then the job compiled (blocks, static shapes; torch 2.11's failing Inductor pass off).
step mfu_512_compiled 170 env TORCHINDUCTOR_COALESCE_TILING_ANALYSIS=0 $PY bench/bench_pretrain_mfu.py \
    "${mfu[@]}" --compile --json "$OUT/mfu_512_compiled.json"
echo "== done in ${SECONDS}s" | tee -a "$LOG"
