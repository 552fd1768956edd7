#!/usr/bin/env bash
# ON THE DEVICE, after `suite.sh setup`: every pending H200 step in one background run. `suite.sh pipeline`
# starts it under setsid in a copy of the repo (/tmp/repo, so it outlives the device call and later calls'
# working trees), with OUT=/tmp/res; `suite.sh collect` returns what it wrote. The steps are suite.sh's own,
# each bounded by its timeout; $OUT/steps.txt gets a line per step (exit code, seconds); $OUT/DONE marks the end.
# The plan (third H200 window, 2026-12-01):
#   A  issue 13's draft: regenerate (vLLM) + gate, then online training + export; then, once B and C are done
#      (so its tokens/s are not contended), serve_eval (reference + vLLM k=3, batch 1 and 8), SGLang serving,
#      vLLM at k=5 and on HumanEval
#   B  (during A's training) issue 12 item 5: the seeds' case, then the crosscheck (which engine departs)
#   C  (during A's training) issue 13's scaling subsets (1, 2, 4 shards of A's tokens store)
# B's engines start while A trains: vLLM's start-up asserts when another process frees GPU memory during its
# profiling, and a training process's caching allocator holds its memory once warm.
set -u
S="bash $REPO_ROOT/scripts/gpu_engines/suite.sh"
export OUT=${OUT:?suite.sh pipeline sets it} REPO_ROOT=${REPO_ROOT:?suite.sh pipeline sets it}
export EAGLEPIPE_VLLM_ARGS=${EAGLEPIPE_VLLM_ARGS:-'{"gpu_memory_utilization": 0.15}'}
export EAGLEPIPE_SGLANG_ARGS=${EAGLEPIPE_SGLANG_ARGS:-'{"mem_fraction_static": 0.3}'}
step() {  # step ARGS...: one suite.sh step, a line in $OUT/steps.txt
  local t0=$SECONDS; $S "$@"; echo "$* rc=$? ${SECONDS}s-since-start $((SECONDS - t0))s" >> "$OUT/steps.txt"
}
echo "start $(date -u +%FT%TZ)" > "$OUT/steps.txt"
step draft-data
(step seeds; step crosscheck; touch "$OUT/B.done") &
(sleep 20; step scaling; touch "$OUT/C.done") &  # after draft-train has merged params.yaml again
step draft-train
for _ in $(seq 120); do [ -f "$OUT/B.done" ] && [ -f "$OUT/C.done" ] && break; sleep 5; done  # ≤ 10 min
step draft-serve
step draft-sglang
step draft-extra
wait
date -u +%FT%TZ > "$OUT/DONE"
