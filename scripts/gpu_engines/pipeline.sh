#!/usr/bin/env bash
# ON THE DEVICE, after `suite.sh setup`: every pending H200 step in one background run. `suite.sh pipeline`
# starts it under setsid from a copy of this folder (so it outlives the device call), with OUT=/tmp/res;
# `suite.sh collect` returns what it wrote. The steps are suite.sh's own (this copy's), each bounded by its
# timeout; $OUT/steps.txt gets a line per step (exit code, seconds) and $OUT/DONE marks the end.
# Extraction runs alone, so its tokens/s are clean (issue 12 item 3); then three branches at once, each engine
# on a small GPU memory share (EAGLEPIPE_VLLM_ARGS / EAGLEPIPE_SGLANG_ARGS, read by every engine):
#   validate, then the seeds' case (issue 12 items 3, 5)
#   numerics base → serve → fix → serve-fix (issue 16, vLLM bf16 against fp8)
#   online vs offline training (issue 11; contended by the other two), then the reference decoder
set -u
S="bash $(dirname "$0")/suite.sh"
export OUT=${OUT:?suite.sh pipeline sets it} REPO_ROOT=${REPO_ROOT:?suite.sh pipeline sets it}
export EAGLEPIPE_VLLM_ARGS=${EAGLEPIPE_VLLM_ARGS:-'{"gpu_memory_utilization": 0.15}'}
export EAGLEPIPE_SGLANG_ARGS=${EAGLEPIPE_SGLANG_ARGS:-'{"mem_fraction_static": 0.3}'}
step() {  # step ARGS...: one suite.sh step, a line in $OUT/steps.txt
  local t0=$SECONDS; $S "$@"; echo "$* rc=$? ${SECONDS}s-since-start $((SECONDS - t0))s" >> "$OUT/steps.txt"
}
echo "start $(date -u +%FT%TZ) vllm=$EAGLEPIPE_VLLM_ARGS sglang=$EAGLEPIPE_SGLANG_ARGS" > "$OUT/steps.txt"
step extract
(step validate; step seeds) &
(for part in base serve fix serve-fix; do step numerics "$part"; done) &
(step online; step reference) &
wait
date -u +%FT%TZ > "$OUT/DONE"
