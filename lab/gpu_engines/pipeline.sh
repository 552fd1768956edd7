#!/usr/bin/env bash
# ON THE DEVICE, after `suite.sh setup`: every pending H200 step in one background run. `suite.sh pipeline`
# starts it under setsid in a copy of the repo (/tmp/repo, so it outlives the device call and later calls'
# working trees), with OUT=/tmp/res; `suite.sh collect` returns what it wrote. The steps are suite.sh's own,
# each bounded by its timeout; $OUT/steps.txt gets a line per step (exit code, seconds); $OUT/DONE marks the end.
# The plan: the steps of $PLAN, one after the other (the third window's lesson: two online trainings and an
# engine at once split the GPU, and the full draft's training did not finish). Default (after the seventh
# window, which trained a draft on the later turns too, GPU_SET="prompts.max_turns=2 train.epochs=4", kept it
# as carry c08 and served it with SGLang and vLLM): issue 11's online vs online_serial vs offline with their
# profiles (online), the CUDA tests, the side-stream one included (gpu-tests), then that kept draft back
# (draft-restore: stash c08 after c01..c07, before setup; it fails without c08, and so does what follows)
# served by vLLM at k=5 and on HumanEval (draft-extra). A new draft: PLAN="draft-data draft-train draft-keep
# draft-sglang draft-vllm" (~25 min with carries and set-up, the seventh window's). Issue 13's next run (the
# eighth window's, lost mid-training): that plan with GPU_SET="prompts.synthetic=16000 train.epochs=4
# train.draft_vocab_size=16384" VDTYPES=bfloat16 (draft-data 566 s). Four windows in a row lost the machine
# mid-run to a gap between calls (suite.sh watch), so each finished part now comes back: PLAN="draft-data data-keep
# draft-train draft-keep draft-vllm draft-sglang draft-simgap"; a window after one lost past data-keep stashes c09,
# c09b (keep_drafter.sh draftdata FILES_AT...) and runs PLAN="data-restore draft-train draft-keep ..." (same
# GPU_SET); after one lost past draft-keep, it stashes c08 and runs PLAN="draft-restore draft-vllm draft-sglang".
# Hold the machine with `suite.sh watch` calls while it runs (suite.sh: why).
# Together they need more than one 30-minute window: what did not finish is simply missing from `collect`'s
# res.tgz.
set -u
S="bash $REPO_ROOT/lab/gpu_engines/suite.sh"
export OUT=${OUT:?suite.sh pipeline sets it} REPO_ROOT=${REPO_ROOT:?suite.sh pipeline sets it}
export EAGLEPIPE_VLLM_ARGS=${EAGLEPIPE_VLLM_ARGS:-'{"gpu_memory_utilization": 0.15}'}
export EAGLEPIPE_SGLANG_ARGS=${EAGLEPIPE_SGLANG_ARGS:-'{"mem_fraction_static": 0.3}'}
step() {  # step ARGS...: one suite.sh step, a line in $OUT/steps.txt
  local t0=$SECONDS; $S "$@"; echo "$* rc=$? ${SECONDS}s-since-start $((SECONDS - t0))s" >> "$OUT/steps.txt"
}
echo "start $(date -u +%FT%TZ)" > "$OUT/steps.txt"
for s in ${PLAN:-online gpu-tests draft-restore draft-extra}; do step "$s"; done
date -u +%FT%TZ > "$OUT/DONE"
