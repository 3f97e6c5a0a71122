#!/usr/bin/env bash
# Keys and queries at cache.key_layer=0 before dropout (the model's behaviour) against the
# dropped-out embeddings (the behaviour it replaced: Transformer-XL's layer 0 stored as it is),
# at GPU size on +experiment=wt2_char with exact 8-gram retrieval: 64 streams a step, about 4
# minutes of training each (train.max_time=240), both runs at once on one GPU, then the
# training-mode self-score of each checkpoint (tools/keylayer0_selfscore.py).
# docs/method.md §3, "Keys and queries at layer 0"; the CPU measurement is in docs/results.md.
#
#   CRTN_DATA=/path/to/data OUT=/path/to/out bash tools/gpu_keylayer0.sh
#
# Writes OUT/clean and OUT/dropped (results.json, metrics.jsonl, train.log, selfscore.txt) and
# OUT/summary.txt; checkpoints stay in the run directories under ${RUNS:-/tmp/keylayer0}.
set -euo pipefail
OUT=${OUT:?set OUT to the folder that receives the results}
RUNS=${RUNS:-/tmp/keylayer0}
EXACT="cache.layers=null cache.key_layer=0 summary.ngram=8 summary.cosine=true cache.top_k=1 cache.alpha_norm=topk"
ARGS="+experiment=wt2_char $EXACT train.device=cuda data.batch_size=64 data.eval_batch_size=64
    train.max_step=5000 train.max_time=240 train.eval_interval=1000 train.progress=false"
# the replaced behaviour: the model with clean_layer0 off (layer 0 stored after dropout)
DROPPED='import sys, crtn.model.crtn as c
init = c.CRTN.__init__
def patched(self, *a, **k):
    init(self, *a, **k)
    self.clean_layer0 = False
c.CRTN.__init__ = patched
from crtn.train import main
sys.argv[0] = "crtn-train"
main()'
mkdir -p "$OUT/clean" "$OUT/dropped"
# shellcheck disable=SC2086
crtn-train $ARGS hydra.run.dir="$RUNS/clean" > "$OUT/clean/stdout.txt" 2>&1 &
clean=$!
# shellcheck disable=SC2086
python -c "$DROPPED" $ARGS hydra.run.dir="$RUNS/dropped" > "$OUT/dropped/stdout.txt" 2>&1 &
dropped=$!
status=0
wait $clean || status=$?
wait $dropped || status=$?
here=$(cd "$(dirname "$0")" && pwd)
for v in clean dropped; do
    for f in results.json metrics.jsonl train.log; do
        [ -f "$RUNS/$v/$f" ] && cp "$RUNS/$v/$f" "$OUT/$v/"
    done
    if [ -f "$RUNS/$v/checkpoints/best.pt" ]; then
        python "$here/keylayer0_selfscore.py" "$RUNS/$v/checkpoints/best.pt" > "$OUT/$v/selfscore.txt" 2>&1 || status=$?
    fi
done
python - "$OUT" > "$OUT/summary.txt" <<'PY'
import json, sys
from pathlib import Path
for v in ("clean", "dropped"):
    p = Path(sys.argv[1]) / v / "results.json"
    if not p.exists():
        print(f"{v}: no results.json")
        continue
    r = json.loads(p.read_text())
    print(f"{v}: steps {r.get('steps')}, valid bpc {r['valid']['bpc']:.4f}, test bpc {r['test']['bpc']:.4f}, "
          f"{r.get('tokens_per_s') or 0:,.0f} tok/s, stopped by {r.get('stopped_by')}")
PY
cat "$OUT/summary.txt" "$OUT"/*/selfscore.txt 2>/dev/null || true
exit $status
