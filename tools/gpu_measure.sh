#!/usr/bin/env bash
# The GPU measurements of docs/results.md ("The cost table on a GPU", "Equal time on a GPU"), one
# script for one lease of a GPU machine:
#
#   CRTN_DATA=/path/to/data OUT=/path/to/out bash tools/gpu_measure.sh [EQUAL_TIME_SECONDS]
#
# 1. the cost table at the standard sizes with 64 streams (crtn-bench's table section): the default
#    model, the CRTN authors' model, selection inside attention with the best-row key (in every layer
#    and in the top two), exact 8-gram retrieval; float32 (TF32 products) and bf16 autocast;
# 2. FlexAttention against the eager attention (tools/gpu_attention_check.py);
# 3. character-level WikiText-2 at wt2_char_large's size with the same wall-clock budget for
#    Transformer-XL and CRTN (exact 8-gram retrieval), side by side on the GPU, learning rate
#    decaying as 1/sqrt(step) so that the schedule does not depend on where the budget stops a run.
# Each step writes under OUT as it finishes, so a lease that ends early keeps what was done; they
# run in the order float32 table, equal time, bf16 table, FlexAttention check.
set -uo pipefail
OUT=${OUT:?set OUT to the folder that receives the results}
T=${1:-180}
EXACT="cache.layers=null cache.key_layer=0 summary.ngram=8 summary.cosine=true cache.top_k=1 cache.alpha_norm=topk"
ROWS=(bench.sections=[table] bench.device=cuda bench.batch=64 bench.rounds=5 bench.memory=true
    "bench.only=[default,crtn_original,gate_token_max,gate_token_max_layers2,exact8]"
    "+bench.rows.exact8=['${EXACT// /\',\'}']")
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
crtn-bench "${ROWS[@]}" bench.out="$OUT/bench_fp32" > "$OUT/bench_fp32.log" 2>&1
RUNS=${RUNS:-/tmp/equal_time}
# shellcheck disable=SC2086
for m in txl crtn; do
    crtn-train +experiment=wt2_char_large model=$m train.device=cuda optim.scheduler=inv_sqrt data.root="${CRTN_DATA:-data}" \
        train.max_step=100000 train.max_time="$T" train.eval_interval=500 train.progress=false \
        hydra.run.dir="$RUNS/$m" > "$OUT/equal_time_$m.log" 2>&1 &
done
wait
for m in txl crtn; do
    tail -n 4 "$OUT/equal_time_$m.log" >> "$OUT/summary.txt"
    cp "$RUNS/$m/metrics.jsonl" "$OUT/equal_time_${m}_metrics.jsonl" 2>/dev/null
done
crtn-bench "${ROWS[@]}" bench.amp=true bench.out="$OUT/bench_bf16" > "$OUT/bench_bf16.log" 2>&1
python3 tools/gpu_attention_check.py --out "$OUT/flex_check.md" > "$OUT/flex_check.log" 2>&1
