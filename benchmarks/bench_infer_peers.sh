#!/usr/bin/env bash
# Batched generation: swiftlite infer vs ms-swift `swift infer` (transformers backend), same model,
# same prompts, greedy, same max_new_tokens and batch size. Prints one JSON line per tool and the
# ratio. Generated tokens are counted by re-tokenising each answer with the model's tokenizer;
# time is the whole command (start-up and model load included, as a user waits for it).
#   bash benchmarks/bench_infer_peers.sh            (after benchmarks/peers/install_peers.sh)
# Env: MODEL (default /tmp/bench_models/smol135m), DATA (a messages JSONL; default the bench
# data), N prompts (32), NEW tokens (128), BATCH (8), VENVS (/tmp/bench_venvs), OUT (/tmp/bench_infer).
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$HERE/.venv/bin/python}
VENVS=${VENVS:-/tmp/bench_venvs}
MODEL=${MODEL:-/tmp/bench_models/smol135m}
DATA=${DATA:-/tmp/bench_data/train.jsonl}
N=${N:-32}; NEW=${NEW:-128}; BATCH=${BATCH:-8}
OUT=${OUT:-/tmp/bench_infer}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
mkdir -p "$OUT"
head -n "$N" "$DATA" > "$OUT/prompts.jsonl"

timed() {  # NAME RESULT_FILE CMD... -> NAME seconds
  local name=$1 res=$2; shift 2
  rm -f "$res"
  local t0=$EPOCHREALTIME
  "$@" > "$OUT/$name.log" 2>&1 || { echo "$name failed, see $OUT/$name.log" >&2; tail -20 "$OUT/$name.log" >&2; exit 1; }
  echo "$name $(awk "BEGIN{print $EPOCHREALTIME - $t0}")" >> "$OUT/times.txt"
}
rm -f "$OUT/times.txt"
timed swiftlite "$OUT/swiftlite.jsonl" "$HERE/.venv/bin/swiftlite" infer --model "$MODEL" \
  --template chatml --torch_dtype float32 --val_dataset "$OUT/prompts.jsonl" \
  --result_path "$OUT/swiftlite.jsonl" --max_new_tokens "$NEW" --temperature 0 \
  --max_batch_size "$BATCH"
timed msswift "$OUT/msswift.jsonl" "$VENVS/msswift/bin/swift" infer --model "$MODEL" \
  --model_type llama --template chatml --torch_dtype float32 --infer_backend transformers \
  --val_dataset "$OUT/prompts.jsonl" --result_path "$OUT/msswift.jsonl" \
  --max_new_tokens "$NEW" --temperature 0 --max_batch_size "$BATCH"

"$PY" - "$MODEL" "$OUT" <<'EOF'
import json, re, sys
from transformers import AutoTokenizer
model, out = sys.argv[1:]
tok = AutoTokenizer.from_pretrained(model)
times = dict(line.split() for line in open(f"{out}/times.txt"))
res = {}
for tool in ("swiftlite", "msswift"):
    rows = [json.loads(x) for x in open(f"{out}/{tool}.jsonl")]
    n = sum(len(tok(r["response"], add_special_tokens=False)["input_ids"]) for r in rows)
    s = float(times[tool])
    # generation alone, as each tool reports it (model load and start-up excluded)
    log = open(f"{out}/{tool}.log", errors="replace").read()
    m = re.findall(r"answers in ([0-9.]+) s" if tool == "swiftlite" else r"'runtime': ([0-9.]+)", log)
    gen = float(m[-1]) if m else None
    res[tool] = (n / s, n / gen if gen else None)
    print(json.dumps({"tool": tool, "prompts": len(rows), "generated_tokens": n,
                      "wall_s": round(s, 2), "tokens_per_s": round(n / s, 1),
                      "generate_s": gen, "generate_tokens_per_s": round(n / gen, 1) if gen else None}))
ratio = {"ratio_wall": round(res["swiftlite"][0] / res["msswift"][0], 2)}
if res["swiftlite"][1] and res["msswift"][1]:
    ratio["ratio_generate"] = round(res["swiftlite"][1] / res["msswift"][1], 2)
print(json.dumps({"swiftlite_vs_msswift": ratio}))
EOF
