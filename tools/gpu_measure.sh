#!/usr/bin/env bash
# The GPU measurements of docs/results.md ("On a GPU: the cost table, compiled layers, FlexAttention
# and equal time"), one script for one lease of a GPU machine:
#
#   CRTN_DATA=/path/to/data OUT=/path/to/out bash tools/gpu_measure.sh [EQUAL_TIME_SECONDS]
#
# STEPS (a space-separated list; all six by default: bench_fp32 profile equal_time bench_bf16
# flex_check compiled_check) runs some of them, in this order; BEFORE (a commit, or a folder holding
# its files: tools/bench_grouped.py's --before) adds that code's rows to the profile, side by side.
#
# 1. the cost table at the standard sizes with 64 streams (crtn-bench's table section): crtn's
#    default model (the lookup), the row match in its place (query=token), the CRTN authors'
#    model, selection inside attention with the best-row key (every layer, k 2) and exact 8-gram
#    retrieval (the row match at layer 0, in the default's two layers); float32 with TF32 products;
# 2. where the steps of the default, the row match and exact 8-gram retrieval spend their time
#    against Transformer-XL's (tools/bench_grouped.py --profile: operators by CPU and by GPU time, and how
#    much of a step the GPU is busy);
# 3. character-level WikiText-2 at wt2_char_large's size with the same wall-clock budget for
#    Transformer-XL and crtn's default (+experiment=wt2_char_large_time), side by side on the GPU;
# 4. the cost table's Transformer-XL, default, row-match and authors' rows under bf16 autocast;
# 5. FlexAttention, then compiled layers, against the eager model (tools/gpu_attention_check.py).
# Each step has a time limit and writes under OUT as it finishes (OUT/timeline.txt: when each
# started and its exit status), so a lease that ends early keeps what was done.
set -uo pipefail
OUT=${OUT:?set OUT to the folder that receives the results}
T=${1:-180}
DEVICE=${DEVICE:-cuda}  # cpu: a dry run of the script here
export PYTHONUNBUFFERED=1
# TF32 products in the apps (which leave torch's default, float32); not for the agreement checks of
# tools/gpu_attention_check.py, which turn TF32 off themselves and would be overridden by this
TF32=(env TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1)
EXACT2="query=token cache.key_layer=0 summary.ngram=8 summary.cosine=true cache.top_k=1 cache.alpha_norm=topk"
EXACT="cache.layers=null $EXACT2"
ROWS=(bench.sections=[table] bench.device="$DEVICE" bench.batch=64 bench.rounds=5
    "+bench.rows.exact8=['${EXACT// /\',\'}']" "+bench.rows.exact8_layers2=['${EXACT2// /\',\'}']")
FP32=("bench.only=[default,row_match,crtn_original,gate_token_max,exact8_layers2]")
BF16=("bench.only=[default,row_match,crtn_original]")
STEPS=" ${STEPS:-bench_fp32 profile equal_time bench_bf16 flex_check compiled_check} "
# wanted NAME: whether STEPS names NAME
wanted() { [[ $STEPS == *" $1 "* ]]; }
# step NAME SECONDS COMMAND...: run COMMAND with a time limit, its output in OUT/NAME.log
step() {
    local name=$1 limit=$2
    shift 2
    wanted "$name" || return 0
    echo "$(date +%T) $name (limit ${limit}s)" >> "$OUT/timeline.txt"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$(date +%T) $name exit $rc" >> "$OUT/timeline.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c 'import torch; print("torch", torch.__version__)' >> "$OUT/gpu.txt" 2>&1
step bench_fp32 110 "${TF32[@]}" python3 -m crtn.bench "${ROWS[@]}" "${FP32[@]}" bench.out="$OUT/bench_fp32" \
    hydra.run.dir=/tmp/bench_fp32
BEFORE_ARGS=()
[[ -n ${BEFORE:-} ]] && BEFORE_ARGS=(--before "$BEFORE") && PROFILE_LIMIT=90
step profile "${PROFILE_LIMIT:-50}" "${TF32[@]}" python3 tools/bench_grouped.py --device "$DEVICE" --batch 64 \
    --rows default,row_match,ngram8_layers2 --rounds 5 --profile "${BEFORE_ARGS[@]}"
RUNS=${RUNS:-/tmp/equal_time}
if wanted equal_time; then
    # shellcheck disable=SC2086
    for m in txl crtn; do
        echo "$(date +%T) equal_time_$m (budget ${T}s)" >> "$OUT/timeline.txt"
        timeout $((T + 120)) "${TF32[@]}" python3 -m crtn.train +experiment=wt2_char_large_time model=$m \
            train.device="$DEVICE" data.root="${CRTN_DATA:-data}" train.max_time="$T" train.progress=false \
            hydra.run.dir="$RUNS/$m" > "$OUT/equal_time_$m.log" 2>&1 &
    done
    wait
    echo "$(date +%T) equal_time done" >> "$OUT/timeline.txt"
    for m in txl crtn; do
        tail -n 4 "$OUT/equal_time_$m.log" >> "$OUT/summary.txt"
        cp "$RUNS/$m/metrics.jsonl" "$OUT/equal_time_${m}_metrics.jsonl" 2>/dev/null
    done
fi
step bench_bf16 70 "${TF32[@]}" python3 -m crtn.bench "${ROWS[@]}" "${BF16[@]}" bench.amp=true bench.out="$OUT/bench_bf16" \
    hydra.run.dir=/tmp/bench_bf16
step flex_check 90 python3 tools/gpu_attention_check.py --out "$OUT/flex_check.md" --rounds 10 --paths flex
# last: inductor compiles every layer for each shape the memory and cache pass through (minutes)
step compiled_check 200 python3 tools/gpu_attention_check.py --out "$OUT/compiled_check.md" --rounds 10 \
    --paths compiled
