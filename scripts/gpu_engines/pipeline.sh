#!/usr/bin/env bash
# ON THE DEVICE, after `suite.sh setup`: every pending H200 step in one background run (suite.sh `pipeline`
# starts it under setsid, so it outlives the device call; `suite.sh collect` copies what it wrote). Results
# and logs go to $RES (default /tmp/res); $RES/DONE marks the end. Phase 1 runs alone, so its tokens/s are
# clean: extraction through hf then vLLM (issue 12 item 3). Phase 2 runs three branches at once (each engine
# with a small GPU memory share, EAGLEPIPE_VLLM_ARGS / EAGLEPIPE_SGLANG_ARGS):
#   A  validate through vLLM then SGLang on the vLLM features (item 3); the seeds' case (item 5)
#   C  issue 16: numerics base → serve-base → fix → serve-fix (vLLM bf16 vs fp8)
#   D  issue 11: online vs offline training tokens/s (beside A and C: contended, said so in its JSON's log),
#      then the reference decoder on the serve step's prompts with its greedy outputs kept
# Every step is bounded by `timeout`, so a hang costs its bound and the rest still runs.
set -u
cd "${REPO_ROOT:?suite.sh pipeline sets it}"
RES=${RES:-/tmp/res}; mkdir -p "$RES"
d=scripts/gpu_engines/device.sh
P=${P:-24}; NEW=${NEW:-128}; NCONV=${NCONV:-64}
B="python3 benchmarks/h200_engines.py --out $RES --prompts $P --max-new $NEW --n $NCONV"
venv() { source <($d env "$1"); export PYTHONPATH="$PWD:$PYTHONPATH"; }
step() {  # step NAME SECONDS ENGINE CMD...: one bounded step, its log in $RES/NAME.log, a line in $RES/steps.txt
  local name=$1 t=$2 eng=$3; shift 3; local t0=$SECONDS
  (venv "$eng"; timeout -k 15 "$t" "$@" > "$RES/$name.log" 2>&1); local rc=$?
  echo "$name rc=$rc ${SECONDS}s-since-start $((SECONDS - t0))s" >> "$RES/steps.txt"
}
export EAGLEPIPE_VLLM_ARGS=${EAGLEPIPE_VLLM_ARGS:-'{"gpu_memory_utilization": 0.15}'}
export EAGLEPIPE_SGLANG_ARGS=${EAGLEPIPE_SGLANG_ARGS:-'{"mem_fraction_static": 0.3}'}
echo "start $(date -u +%FT%TZ) vllm=$EAGLEPIPE_VLLM_ARGS sglang=$EAGLEPIPE_SGLANG_ARGS" > "$RES/steps.txt"
step extract_hf 120 vllm $B extract hf
step extract_vllm 360 vllm $B extract vllm
(
  step validate_vllm 240 vllm $B validate vllm
  step validate_sglang 240 sglang $B validate sglang
  step seeds_vllm 300 vllm $B seeds vllm
  step seeds_sglang 360 sglang $B seeds sglang
) &
(
  NUM="python3 benchmarks/numerics.py --engine vllm --quantization ${NUMQ:-fp8} --dtype bfloat16 --out $RES
       --target /tmp/w/target --prompts /tmp/eng/inputs/prompts --work /tmp/w/numerics-vllm --n ${NNUM:-128}
       --eval-prompts $P --max-new $NEW"
  for part in base serve-base fix serve-fix; do step "numerics_$part" 420 vllm $NUM "$part"; done
) &
(
  step online 420 vllm python3 benchmarks/online_train.py --target /tmp/w/target \
    --gguf /tmp/eng/inputs/SmolLM2-135M-Instruct.Q4_1.gguf --work /tmp/online --out "$RES/online_train.json" \
    --samples "${NONLINE:-512}" --min-len 256 --max-len 1024 --batch-tokens 16384 --fast \
    --engine-dtype float32 bfloat16
  step reference 420 vllm $B reference
) &
wait
date -u +%FT%TZ > "$RES/DONE"
