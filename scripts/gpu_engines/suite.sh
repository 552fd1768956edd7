#!/usr/bin/env bash
# ON THE DEVICE (the lent H200), repo root, after the carry calls (README.md here: "the suite"). One step per
# device call; each writes its JSON and log under $OUT; `python benchmarks/h200_engines.py merge --out DIR`
# HERE turns what came back into benchmarks/h200/*.json.
#   suite.sh setup      install vllm, sglang, inputs; check.py for both engines (in parallel); prep the target
#   suite.sh serve-vllm | serve-sglang     EAGLE-3 vs plain, batch 1 and 8, MT-bench first turns
#   suite.sh seeds      item 5: kimi_k2 target, vLLM features, SGLang offsets (exported + planted) and serving;
#                       starts the reference decoder in the background (setsid; its tokens/s are measured
#                       beside this step's GPU work), collected by `extract`, which waits for it first
#   suite.sh extract    item 3: extract through hf and vLLM (tokens/s), validate_offsets through vLLM and SGLang
# Env: P (MT-bench prompts, default 24), NEW (max new tokens, default 128), NCONV (extract, default 64)
set -uo pipefail
cd "$(dirname "$0")/../.."
d=scripts/gpu_engines/device.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=${P:-24}; NEW=${NEW:-128}; NCONV=${NCONV:-64}
B="python3 benchmarks/h200_engines.py --out $OUT --prompts $P --max-new $NEW --n $NCONV"
venv() { source <($d env "$1"); export PYTHONPATH="$PWD:$PYTHONPATH"; }
case ${1:-} in
  setup)
    set -e
    $d install vllm; $d install sglang; $d install inputs
    (venv vllm; python3 -c "import sys; sys.path.insert(0, 'scripts/gpu_engines'); import check; check.build_model()")
    (venv vllm; python3 scripts/gpu_engines/check.py vllm > "$OUT/check_vllm.log" 2>&1) &
    (venv sglang; python3 scripts/gpu_engines/check.py sglang > "$OUT/check_sglang.log" 2>&1) &
    (venv vllm; $B prep > "$OUT/prep.log" 2>&1) &
    set +e; wait; set -e
    grep -h "^CHECK\|^RESULT\|Error" "$OUT"/check_*.log "$OUT/prep.log" | cut -c1-600 ;;
  serve-vllm) venv vllm; $B serve vllm 2>&1 | tee "$OUT/serve_vllm.log" | grep -v "it/s\]" ;;
  serve-sglang) venv sglang; $B serve sglang 2>&1 | tee "$OUT/serve_sglang.log" | grep -v "it/s\]" ;;
  seeds)
    (venv vllm; setsid nohup $B --out /tmp/ref reference > /tmp/ref.log 2>&1 &)
    (venv vllm; $B seeds vllm 2>&1 | tee "$OUT/seeds_vllm.log" | grep -v "it/s\]") &&
    (venv sglang; $B seeds sglang 2>&1 | tee "$OUT/seeds_sglang.log" | grep -v "it/s\]") ;;
  extract)
    # the reference decoder (started by `seeds`) must be done before anything here is timed
    for _ in $(seq 60); do [ -f /tmp/ref/reference.json ] || ! pgrep -f "h200_engines.py.*reference" >/dev/null && break; sleep 5; done
    (venv vllm; $B extract hf 2>&1 | tee "$OUT/extract_hf.log" | tail -3)
    (venv vllm; $B extract vllm 2>&1 | tee "$OUT/extract_vllm.log" | tail -3)
    (venv vllm; $B validate vllm 2>&1 | tee "$OUT/validate_vllm.log" | tail -3)
    (venv sglang; $B validate sglang 2>&1 | tee "$OUT/validate_sglang.log" | tail -3)
    cp /tmp/ref/reference.json "$OUT/" 2>/dev/null || { echo "reference not finished:"; tail -3 /tmp/ref.log; } ;;
  *) sed -n 2,12p "$0"; exit 2 ;;
esac
