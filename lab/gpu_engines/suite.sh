#!/usr/bin/env bash
# ON THE DEVICE (the lent H200), repo root, after the carry calls (lab/README.md). One step per
# device call; each writes its JSON and log under $OUT; `python lab/h200_engines.py merge --out DIR`
# HERE turns what came back into benchmarks/h200/*.json.
#   suite.sh setup      install vllm, sglang, inputs; check.py for both engines (in parallel); prep the target
#   suite.sh serve-vllm | serve-sglang     EAGLE-3 vs plain, batch 1 and 8, MT-bench first turns
#   suite.sh seeds      item 5: kimi_k2 target, vLLM features, SGLang offsets (exported + planted) and serving;
#   suite.sh crosscheck the seeds' target through vLLM and SGLang against hf fp32, every boundary (which departs)
#   suite.sh extract    item 3: extract through hf and vLLM (tokens/s)
#   suite.sh validate   item 3: validate_offsets' check through vLLM and SGLang on the vLLM features
#   suite.sh online     issue 11 item 4: training tokens/s online (target in the loop) vs offline, SmolLM2 shapes,
#                       target in ONLINE_DTYPES (default bfloat16, the GPU profile's; benchmarks/online_train.py; from setup's prep,
#                       else made from the carried GGUF); writes $OUT/online_train.json (→ benchmarks/h200/)
#   suite.sh numerics base|serve|fix|serve-fix   issue 16 (benchmarks/numerics.py), one part per device call,
#                       after setup: base = hf fp32 features → draft, the gate through vLLM bf16 unquantized and
#                       fp8; serve = that draft served both ways (τ); fix = features extracted by vLLM fp8,
#                       retrained, the gate again; serve-fix = τ of that draft on fp8. HERE: `python
#                       benchmarks/numerics.py rows --out DIR` (DIR = the parts' files together) writes
#                       benchmarks/h200/numerics.json. NUMQ (default fp8) picks the quantization; NUMENGINE=sglang
#                       runs SGLang instead (bf16 only: sgl_kernel's rmsnorm has no fp32 kernel)
#   suite.sh reference  the reference decoder on the serve steps' prompts (greedy outputs kept)
#   suite.sh draft-data | draft-train | draft-serve | draft-vllm | draft-sglang | draft-sglang-variants | draft-extra |
#            scaling   issue 13:
#                       the GPU profile (profiles/gpu.yaml, lab/gpu_run.sh) in the repo's data/: regenerate
#                       (vLLM) + gate; online training + export; serve_eval (reference + vLLM, batch 1 and 8); vLLM
#                       alone (k=3, bf16 and fp32); SGLang serving of that export (and its variants: host trims,
#                       simulated τ 2.5, k=5); vLLM at k=5 and on HumanEval;
#                       the scaling curve's subsets; draft-simgap: the draft's τ_sim on MT-bench and HumanEval;
#                       regen-sampling: what per-prompt seeds cost vLLM's generate (benchmarks/regen_sampling.py)
#   suite.sh gpu-tests  tests/test_gpu.py + test_ttt.py's CUDA cases with vLLM's environment, then the SGLang test
#                       (GPU_TESTS=sglang: that one alone)
#   suite.sh draft-keep | keep | draft-restore   the draft run's data/drafter into ≤ 15 MiB parts (/tmp/keep), those
#                       parts to $OUT (≤ 3 a call), and, in a later window, the carried parts back to data/drafter
#                       + the stages up to export (HERE between them: keep_drafter.sh drafter FILES_AT... → c08)
#   suite.sh ckpt-keep  the same for the best epoch so far of a draft-train still running (a machine about to go)
#   suite.sh data-keep | data-restore   the same for draft-data's output (data/features, data/validated.json):
#                       a later window trains without regenerating (keep_drafter.sh draftdata FILES_AT... → c09..)
#   suite.sh sglang-moe issue 12 item 5: the tiny DeepSeek target's MoE variants through SGLang against hf
#   suite.sh pipeline   the steps of $PLAN (pipeline.sh: its default and why) one after the other, in one
#                       background run in a copy of the repo; then
#   suite.sh watch [S]    hold the machine up to S s (540) while it runs; back when a step ends or fails
#   suite.sh collect [S]  wait up to S s (540) for it, copy its results and logs to $OUT (call it until DONE)
# Env: P (MT-bench prompts, default 24), NEW (max new tokens, default 128), NCONV (extract, default 64),
#      NNUM (numerics: training conversations, default 128),
#      NONLINE (online: samples, default 512; ONLINE_MIN/ONLINE_MAX their lengths, default 256/1024; the GPU
#      profile's ShareGPT rows average 273 tokens), CHECKS (1: run check.py for both engines in setup; 0: skip),
#      PLAN (pipeline: its steps, in order; default in pipeline.sh), SHARDS (scaling: default "1 2 4"),
#      SET (scaling: train params over the profile's, e.g. "train.draft_vocab_size=32768"),
#      GPU_SET (draft-*: params over profiles/gpu.yaml for lab/gpu_run.sh, e.g. "prompts.max_turns=3"),
#      VDTYPES (draft-vllm: serving dtypes, default "bfloat16 float32").
#      Each step bounds its own time (timeout).
# Measured 2026-12-01: setup 222 s (checks included), serve-vllm 271 s (P=24, NEW=128).
set -uo pipefail
cd "${REPO_ROOT:-$(dirname "$0")/../..}"  # pipeline runs a copy of this folder, from the repo root
d=lab/gpu_engines/device.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUN_REPO=${RUN_REPO:-/tmp/repo}  # the copy of the repo a pipeline runs in (tests: elsewhere)
KEEP=${KEEP:-/tmp/keep} RES=${RES:-/tmp/res}  # kept parts, the pipeline's results (lab/tests: elsewhere)
P=${P:-24}; NEW=${NEW:-128}; NCONV=${NCONV:-64}
B="python3 lab/h200_engines.py --out $OUT --prompts $P --max-new $NEW --n $NCONV"
venv() { source <($d env "$1"); export PYTHONPATH="$PWD:$PYTHONPATH"; }
gpu_opts() {  # this machine's engine options (h200_engines.py's GPU_VLLM / GPU_SGLANG) under the ones already in
  # EAGLEPIPE_VLLM_ARGS / EAGLEPIPE_SGLANG_ARGS, for the product's scripts and tests, which read only those
  eval "$(python3 lab/h200_engines.py env)"; }
pending_kept() {  # the kept parts not yet returned
  local p; for p in $KEEP/*.tar.xz.part*; do [ -f "$p" ] && [ ! -f $KEEP/.returned-$(basename "$p") ] && echo "$p"; done
}
return_kept() {  # ≤ 3 pending parts (+ their set's sha256) to $OUT, each part once: the device sends back ≤ 8
  # files and 64 MiB a call (the twelfth window's first watch lost 4 of draftdata's 8 parts so)
  local p; for p in $(pending_kept | head -3); do
    cp $p "${p%.tar.xz.part*}.sha256" "$OUT/" && touch $KEEP/.returned-$(basename $p); done; true
}
keep_set() {  # keep_set NAME DIR WHAT...: DIR's WHAT as NAME.tar.xz in ≤ 15 MiB parts in $KEEP (+ NAME.sha256)
  # xz (KEEP_XZ, default -6): the 120,270 conversations' tokens store went from 417 MiB (28 parts, ten calls to
  # return, seven carry folders) to 47 MiB (4 parts: one carry); xz -6 of it took 80 s on 2 cores here
  local name=$1 dir=$2; shift 2
  mkdir -p $KEEP; rm -f $KEEP/$name.* $KEEP/.returned-$name.*
  tar -cf - -C "$dir" "$@" | xz -T0 ${KEEP_XZ:--6} > $KEEP/$name.tar.xz || return 1
  (cd $KEEP && sha256sum $name.tar.xz > $name.sha256 && split -b 15M -d $name.tar.xz $name.tar.xz.part &&
   rm $name.tar.xz && ls -l $name.*)
}
case ${1:-} in
  setup)
    set -e
    $d install vllm; $d install sglang; $d install inputs
    if ls /tmp/eng/data.tar.part* > /dev/null 2>&1; then $d install data; fi   # the GPU profile's sources (gpu_run.sh)
    if ls /tmp/eng/drafter.tar.xz.part* > /dev/null 2>&1; then $d install drafter; fi   # a kept draft (draft-restore)
    if ls /tmp/eng/draftdata.tar.xz.part* > /dev/null 2>&1; then $d install draftdata; fi   # kept data (data-restore)
    (venv vllm; python3 -c "import sys; sys.path.insert(0, 'lab/gpu_engines'); import check; check.build_model()")
    if [ "${CHECKS:-1}" = 1 ]; then  # CHECKS=0 saves ~2 min once the serve steps are known to work
      (venv vllm; python3 lab/gpu_engines/check.py vllm > "$OUT/check_vllm.log" 2>&1) &
      (venv sglang; python3 lab/gpu_engines/check.py sglang > "$OUT/check_sglang.log" 2>&1) &
    fi
    (venv vllm; $B prep > "$OUT/prep.log" 2>&1) &
    set +e; wait; set -e
    grep -h "^CHECK\|^RESULT\|Error" "$OUT"/check_*.log "$OUT/prep.log" 2>/dev/null | cut -c1-600; true ;;
  serve-vllm) venv vllm; timeout 560 $B serve vllm > "$OUT/serve_vllm.log" 2>&1; grep "RESULT\|Error" "$OUT/serve_vllm.log" | cut -c1-600 ;;
  serve-sglang) venv sglang; timeout 560 $B serve sglang > "$OUT/serve_sglang.log" 2>&1; grep "RESULT\|Error" "$OUT/serve_sglang.log" | cut -c1-600 ;;
  seeds)
    (venv vllm; timeout 240 $B seeds vllm > "$OUT/seeds_vllm.log" 2>&1; grep "RESULT\|Error" "$OUT/seeds_vllm.log" | cut -c1-600) &&
    (venv sglang; timeout 300 $B seeds sglang > "$OUT/seeds_sglang.log" 2>&1; grep "RESULT\|Error" "$OUT/seeds_sglang.log" | cut -c1-600) ;;
  crosscheck)  # the seeds' kimi_k2 target through vLLM and SGLang against hf fp32 at every boundary (which departs)
    (venv vllm; timeout 200 $B crosscheck vllm > "$OUT/crosscheck_vllm.log" 2>&1; grep "RESULT\|Error" "$OUT/crosscheck_vllm.log" | cut -c1-600)
    (venv sglang; timeout 240 $B crosscheck sglang > "$OUT/crosscheck_sglang.log" 2>&1; grep "RESULT\|Error" "$OUT/crosscheck_sglang.log" | cut -c1-600) ;;
  extract)  # item 3, part 1: the same conversations through hf, then vLLM (each bounded, so results come back)
    (venv vllm; timeout 120 $B extract hf > "$OUT/extract_hf.log" 2>&1; tail -2 "$OUT/extract_hf.log")
    (venv vllm; timeout 420 $B extract vllm > "$OUT/extract_vllm.log" 2>&1; tail -2 "$OUT/extract_vllm.log") ;;
  validate)  # item 3, part 2: validate_offsets' check through vLLM and SGLang on the vLLM features
    (venv vllm; timeout 240 $B validate vllm > "$OUT/validate_vllm.log" 2>&1; grep RESULT "$OUT/validate_vllm.log" | cut -c1-400)
    (venv sglang; timeout 300 $B validate sglang > "$OUT/validate_sglang.log" 2>&1; grep RESULT "$OUT/validate_sglang.log" | cut -c1-400) ;;
  reference)  # the reference decoder on serve's prompts, greedy outputs kept (merge compares engines' with them)
    (venv vllm; timeout 420 $B reference > "$OUT/reference.log" 2>&1; grep "RESULT\|Error" "$OUT/reference.log" | cut -c1-600) ;;
  online)  # needs only torch/transformers/safetensors/pydantic (the vllm venv has them); no engine, no DVC
    (venv vllm; timeout 560 python3 benchmarks/online_train.py --target /tmp/w/target \
       --gguf /tmp/eng/inputs/SmolLM2-135M-Instruct.Q4_1.gguf --work /tmp/online --out "$OUT/online_train.json" \
       --samples ${NONLINE:-512} --min-len ${ONLINE_MIN:-256} --max-len ${ONLINE_MAX:-1024} --batch-tokens 16384 \
       --fast --engine-dtype ${ONLINE_DTYPES:-bfloat16} --profile "$OUT/online_profile" > "$OUT/online_train.log" 2>&1
     grep "tok/s\|profiled\|RESULT\|Error" "$OUT/online_train.log" | cut -c1-600) ;;
  numerics)  # issue 16; $2 = base | serve | fix | serve-fix (each bounded, so what ran comes back)
    E=${NUMENGINE:-vllm}; part=${2:-}; [ "$part" = serve ] && part=serve-base
    case $part in base|serve-base|fix|serve-fix) ;; *) echo "numerics needs base, serve, fix or serve-fix"; exit 2 ;; esac
    NUM="python3 benchmarks/numerics.py $part --engine $E --quantization ${NUMQ:-fp8} --dtype bfloat16 --out $OUT
         --target /tmp/w/target --prompts /tmp/eng/inputs/prompts --work /tmp/w/numerics-$E --n ${NNUM:-128}
         --eval-prompts $P --max-new $NEW"
    mkdir -p /tmp/w/numerics-$E  # a step's JSON stays here too: the serve parts read their step's in a later call
    [ "$part" = serve-base ] && cp /tmp/w/numerics-$E/numerics_base.json "$OUT/" 2>/dev/null
    [ "$part" = serve-fix ] && cp /tmp/w/numerics-$E/numerics_fix.json "$OUT/" 2>/dev/null
    (venv "$E"; gpu_opts; timeout 560 $NUM > "$OUT/numerics_${part}_$E.log" 2>&1; status=$?
     cp "$OUT"/numerics_base.json "$OUT"/numerics_fix.json /tmp/w/numerics-$E/ 2>/dev/null
     grep "RESULT\|Error" "$OUT/numerics_${part}_$E.log" | cut -c1-600; exit $status) ;;
  draft-data)  # issue 13: the GPU profile's pipeline up to the offset gate. vLLM regenerates with CUDA graphs, big
    # batches (eager, its generate sat at 0-11 % GPU: 219, 301, 409 s in windows 4-6 for the same 4.4 M tokens, as
    # fast as the host's CPU); the gate's capture instance stays eager (GPU_VLLM_ARGS of its own call). vLLM
    # captures graphs up to batch 512 unless told (config/compilation.py: max_cudagraph_capture_size), so 1024 here.
    # If that fails, extract goes on eager from its first missing shard (shards are written atomically, resumed).
    # DATA_MEM: the fraction all of extract's vLLM instances take together (extract.workers = n: 1/n each).
    M=${DATA_MEM:-0.35}
    G='{"gpu_memory_utilization": '$M', "max_num_seqs": 1024, "enforce_eager": false,
        "compilation_config": {"max_cudagraph_capture_size": 1024}}'
    { GPU_VLLM_ARGS=$G timeout 900 bash lab/gpu_run.sh check_params target prompts extract > "$OUT/draft_data.log" 2>&1 ||
      GPU_VLLM_ARGS='{"gpu_memory_utilization": '$M', "max_num_seqs": 1024}' timeout 900 bash lab/gpu_run.sh \
        extract > "$OUT/draft_data_eager.log" 2>&1; } &&
    GPU_VLLM_ARGS='{"gpu_memory_utilization": 0.35}' timeout 300 bash lab/gpu_run.sh validate_offsets \
      >> "$OUT/draft_data.log" 2>&1; rc=$?
    grep -h "^=== \|Error" "$OUT"/draft_data*.log | cut -c1-400; exit $rc ;;
  draft-train)  # issue 13: online training (the target in the loop) and export; if it fails, once more with the
    # eager capture on a side stream (train.compile_capture false: the seventh window's 108.9k tok/s), resuming
    # from the last checkpoint (the same run key). First what else holds the GPU or the CPU (window 17 trained at
    # about half window 16's speed, cause unmeasured): $OUT/before_train.txt
    { nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
      nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu,utilization.gpu,memory.used --format=csv
      nproc; uptime; ps -eo pid,ppid,pcpu,rss,etimes,comm --sort=-pcpu | head -15; } > "$OUT/before_train.txt" 2>&1
    timeout 1500 bash lab/gpu_run.sh train_drafter export > "$OUT/draft_train.log" 2>&1 ||
      GPU_SET="${GPU_SET:-} train.compile_capture=false" timeout 1500 bash lab/gpu_run.sh train_drafter export \
        > "$OUT/draft_train_eager.log" 2>&1; rc=$?
    grep -h "^=== \|epoch .*tau_sim\|Error" "$OUT"/draft_train*.log | cut -c1-400; exit $rc ;;
  draft-serve)  # issue 13: serve_eval (reference decoder, vLLM k=3 at batch 1 and 8), vLLM with CUDA graphs
    # (eager again if that start fails: the figures then say enforce_eager in reports/serve_eval.json's options)
    GPU_VLLM_ARGS='{"gpu_memory_utilization": 0.3, "enforce_eager": false}' timeout 900 bash lab/gpu_run.sh \
      serve_eval > "$OUT/draft_serve.log" 2>&1 ||
      timeout 900 bash lab/gpu_run.sh serve_eval > "$OUT/draft_serve_eager.log" 2>&1; rc=$?
    grep -h "^=== \|Error" "$OUT"/draft_serve*.log | cut -c1-400; exit $rc ;;
  draft-sglang|draft-sglang-variants|draft-extra|draft-vllm)  # issue 13: the draft run's export served by SGLang (k=3); vLLM at k=3 in
    # each of $VDTYPES (default bfloat16 float32: as trained, and the reference decoder's dtype); vLLM at k=5, HumanEval
    w=/tmp/w13; mkdir -p $w /tmp/w13in; for x in target export drafter; do ln -sfn "$PWD/data/$x" $w/$x; done
    ln -sfn "$PWD/data/prompts" /tmp/w13in/prompts
    D="python3 lab/h200_engines.py --work $w --inputs /tmp/w13in --out $OUT --max-new 128"
    if [ "$1" = draft-sglang ]; then
      (venv sglang  # CUDA graphs: the deep_gemm stand-in + JIT DeepGEMM off, for this command only (its docstring)
       PYTHONPATH="$PWD/lab/gpu_engines/shims_cudagraph:$PYTHONPATH" SGLANG_ENABLE_JIT_DEEPGEMM=0 \
       EAGLEPIPE_SGLANG_ARGS='{"disable_cuda_graph": false, "mem_fraction_static": 0.3}' \
       timeout 600 $D --prompts 80 --tag _draft serve sglang > "$OUT/draft_sglang.log" 2>&1 ||
       { export EAGLEPIPE_SGLANG_ARGS='{"mem_fraction_static": 0.3}'
         timeout 600 $D --prompts 80 --tag _draft serve sglang > "$OUT/draft_sglang_eager.log" 2>&1; }
       grep -h "RESULT\|Error" "$OUT"/draft_sglang*.log | cut -c1-600)
    elif [ "$1" = draft-sglang-variants ]; then  # each of $SGL_VARIANTS (h200_engines.py's SGLANG_VARIANTS; default
      # trim sim25: host trims, then SGLang's simulated acceptance length 2.5), CUDA graphs as draft-sglang's first try
      (venv sglang; export PYTHONPATH="$PWD/lab/gpu_engines/shims_cudagraph:$PYTHONPATH" SGLANG_ENABLE_JIT_DEEPGEMM=0
       export EAGLEPIPE_SGLANG_ARGS='{"disable_cuda_graph": false, "mem_fraction_static": 0.3}'
       for v in ${SGL_VARIANTS-trim sim25}; do
         timeout 420 $D --prompts 80 --variant $v --tag _draft_$v serve sglang > "$OUT/draft_sglang_$v.log" 2>&1
         grep -h "RESULT\|Error" "$OUT/draft_sglang_$v.log" | cut -c1-600
       done)
    elif [ "$1" = draft-vllm ]; then
      (venv vllm; export EAGLEPIPE_VLLM_ARGS='{"gpu_memory_utilization": 0.3, "enforce_eager": false}'
       for dt in ${VDTYPES:-bfloat16 float32}; do
         timeout 400 $D --prompts 80 --dtype $dt --tag _draft_$dt serve vllm > "$OUT/draft_vllm_$dt.log" 2>&1
         grep -h "RESULT\|Error" "$OUT/draft_vllm_$dt.log" | cut -c1-600
       done)
    else
      (venv vllm; export EAGLEPIPE_VLLM_ARGS='{"gpu_memory_utilization": 0.3, "enforce_eager": false}'
       timeout 500 $D --prompts 80 --k 5 --tag _draft_k5 serve vllm > "$OUT/draft_k5.log" 2>&1
       timeout 500 $D --prompts 164 --source humaneval --tag _draft_humaneval serve vllm > "$OUT/draft_humaneval.log" 2>&1
       grep -h "RESULT\|Error" "$OUT"/draft_k5.log "$OUT"/draft_humaneval.log | cut -c1-600)
    fi ;;
  draft-simgap)  # issue 13: the draft's τ_sim on the serving prompts (benchmarks/sim_gap.py): data or serving?
    (venv vllm; export PYTHONPATH="$PWD:/tmp/eaglepipe-pkgs:$PYTHONPATH"  # gpu_run.sh's bundled MT-bench, HumanEval
     for src in mtbench humaneval; do n=80; [ $src = humaneval ] && n=164
       timeout 300 python3 benchmarks/sim_gap.py --target data/target --drafter data/drafter --source $src --n $n \
         --max-new 128 --out "$OUT/sim_gap_$src.json" > "$OUT/sim_gap_$src.log" 2>&1
       grep -h "RESULT\|Error" "$OUT/sim_gap_$src.log" | cut -c1-500; done) ;;
  regen-sampling)  # issue 13: per-prompt seeds vs one unseeded SamplingParams vs greedy on the target's user-turn
    # prompts, one vLLM instance (benchmarks/regen_sampling.py; after draft-data: data/target)
    (venv vllm; timeout 300 python3 benchmarks/regen_sampling.py --target data/target --n ${NREGEN:-8192} \
       --out "$OUT/regen_sampling.json" > "$OUT/regen_sampling.log" 2>&1
     grep -h "RESULT\|Error" "$OUT/regen_sampling.log" | cut -c1-600) ;;
  gpu-tests)  # tests/test_gpu.py (+ test_ttt.py, test_online.py: their CUDA cases) under each engine's environment
    # (CI skips them); GPU_TESTS names the environments (default "vllm sglang"; "sglang": its one test, ~1 min)
    for e in ${GPU_TESTS:-vllm sglang}; do case $e in
      vllm) (venv vllm; timeout 400 python3 -m pytest -q -ra tests/test_gpu.py tests/test_ttt.py tests/test_graphed.py \
               tests/test_online.py::test_rows_captured_on_a_side_stream_equal_the_serial_ones > "$OUT/gpu_tests_vllm.log" 2>&1
             tail -4 "$OUT/gpu_tests_vllm.log") ;;
      sglang) (venv sglang; export EAGLEPIPE_SGLANG_ARGS='{"mem_fraction_static": 0.3}'; gpu_opts
               timeout 300 python3 -m pytest -q -ra tests/test_gpu.py -k sglang > "$OUT/gpu_tests_sglang.log" 2>&1
               tail -4 "$OUT/gpu_tests_sglang.log") ;;
      *) echo "GPU_TESTS: vllm and/or sglang, not $e"; exit 2 ;;
    esac; done ;;
  draft-keep|data-keep)  # issue 13: data/drafter (draft-keep), or draft-data's output, the tokens store and the
    # gate's verdict (data-keep), as ≤ 15 MiB parts in /tmp/keep (the machine keeps nothing once given back). `watch`
    # returns their parts, ≤ 3 a call, each once (or `suite.sh keep` calls); HERE `keep_drafter.sh NAME FILES_AT...`
    # makes them carry c08.. (drafter) or c09, c09b.. (draftdata), and a later window's `setup` + `draft-restore` serves that
    # draft without draft-data and draft-train, or `data-restore` trains without draft-data (the same GPU_SET)
    if [ "$1" = data-keep ]; then keep_set draftdata data features validated.json; else keep_set drafter data drafter; fi ;;
  ckpt-keep)  # the best epoch so far of the draft-train still running in $RUN_REPO (lab/save_best_so_far.py),
    # kept as draft-keep keeps a finished draft (same name: keep_drafter.sh drafter, draft-restore), its first ≤ 3
    # parts returned by this call: for a machine about to be taken back mid-training
    t=$(mktemp -d)
    (cd $RUN_REPO && venv vllm && python3 lab/save_best_so_far.py data/drafter "$t/drafter") || exit 1
    keep_set drafter "$t" drafter && return_kept && ls -l "$OUT"; rc=$?; rm -rf "$t"; exit $rc ;;
  keep) return_kept && ls -l "$OUT" ;;
  draft-restore|data-restore)  # a kept set (installed by setup) back in data/, then the stages it needs:
    # draft-restore: c08's draft + the stages up to export; data-restore: c09's tokens store and gate verdict +
    # target and prompts (deterministic, ~50 s), so draft-train follows (GPU_SET as when it was kept)
    name=drafter c=c08 stages="check_params target prompts export"
    [ "$1" = data-restore ] && name=draftdata c=c09 stages="check_params target prompts"
    src=/tmp/eng/$name; log="$OUT/${1/-/_}.log"
    [ -n "$(ls -A $src 2>/dev/null)" ] || { echo "no carried $name in $src (stash $c before setup)"; exit 1; }
    mkdir -p data; for x in $src/*; do rm -rf "data/$(basename "$x")"; done; cp -r $src/* data/
    timeout 300 bash lab/gpu_run.sh $stages > "$log" 2>&1; rc=$?
    grep "^=== \|Error" "$log" | cut -c1-400; exit $rc ;;
  sglang-moe)  # issue 12 item 5: which part of SGLang 0.5.17's DeepSeek path departs (lab/sglang_moe_variants.py)
    (venv sglang; timeout 330 python3 lab/sglang_moe_variants.py --out "$OUT" --work /tmp/w/moe --budget 270 \
       > "$OUT/sglang_moe.log" 2>&1; grep "RESULT\|Error" "$OUT/sglang_moe.log" | cut -c1-500) ;;
  scaling)  # issue 13: drafts on the first 1, 2, 4 shards of the draft run's tokens store (benchmarks/scaling.py)
    (venv vllm; export PYTHONPATH="$PWD:/tmp/eaglepipe-pkgs:$PYTHONPATH"
     timeout 1500 python3 benchmarks/scaling.py train --shards ${SHARDS:-1 2 4} ${SET:+--set $SET} --out "$OUT" \
       >> "$OUT/scaling.log" 2>&1
     grep "RESULT\|Error" "$OUT/scaling.log" | cut -c1-400) ;;
  pipeline)  # everything pending at once, in the background (pipeline.sh says what and in which order)
    # It runs in a copy of the repo: the working tree is sent again with every call (params.yaml, which
    # gpu_run.sh merges, included), and bash reads a script as it goes.
    # A pipeline still running (a watch that returned at a Traceback while the step's other processes went on)
    # is stopped first, its whole session: the seventeenth window's restart ran beside the old one's extract
    # workers, in the same scratch folder, and both failed.
    old=$(cat $RES/pipeline.pid 2>/dev/null)
    if [ -n "$old" ] && kill -0 "$old" 2>/dev/null; then
      echo "stopping the pipeline still running (session $old)"
      kill -TERM -- -"$old" 2>/dev/null; sleep 10; kill -KILL -- -"$old" 2>/dev/null
    fi
    mkdir -p $RES $RUN_REPO; tar -cf - --exclude=./.gpu --exclude=./data . | tar -xf - -C $RUN_REPO
    REPO_ROOT=$RUN_REPO OUT=$RES setsid nohup bash $RUN_REPO/lab/gpu_engines/pipeline.sh \
      > $RES/pipeline.log 2>&1 < /dev/null &
    echo $! > $RES/pipeline.pid  # setsid execs (a background job is no group leader): this pid leads the session
    sleep 5; cat $RES/steps.txt ;;
  watch)  # hold the machine up to $2 s (default 540) while pipeline runs: back as soon as a step fails, kept
    # parts wait to be returned, DONE appears or a log gets a Traceback, with the steps so far and the running
    # step's last lines; a step that ends well does not end the call (each return is a round trip, and the
    # sixteenth window lost its machine, draft and sim_gap in one over 30 s). The machine is
    # given back 30 s after a call ends (the fifth window lost its run to a fix made between two calls), so
    # call watch again at once, and make fixes inside a call (edit /tmp/repo from the command), not between.
    # A fresh machine (the last one went back: no /tmp/res) returns at once instead of waiting S s for nothing
    # (the ninth window lost 540 s so). Each call returns res.tgz (every JSON and log so far) and ≤ 3 parts not yet
    # returned of what draft-keep and data-keep kept (while some are left, at once), so a machine lost later loses
    # only the step that was running.
    [ -f $RES/steps.txt ] || { echo "no pipeline here ($RES missing): the machine was given back; start again"; exit 3; }
    f0=$(grep -Evc " rc=0( |$)" $RES/steps.txt); t0=$(cat $RES/*.log 2>/dev/null | grep -c Traceback); wait_s=${2:-540}
    for _ in $(seq $(( wait_s / 5 ))); do  # parts to return: no waiting
      [ -f $RES/DONE ] || [ -n "$(pending_kept)" ] || [ "$(grep -Evc " rc=0( |$)" $RES/steps.txt)" != "$f0" ] ||
        [ "$(cat $RES/*.log 2>/dev/null | grep -c Traceback)" != "$t0" ] && break; sleep 5; done
    cat $RES/steps.txt; f=$(ls -t $RES/*.log | head -1); echo "--- $f"
    grep -a "^=== \|epoch \|RESULT\|Error" "$f" | tail -6 | cut -c1-300
    tar -czf "$OUT/res.tgz" -C $RES .; return_kept
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader ;;
  collect)  # wait up to $2 s (default 540) for pipeline's DONE, then copy what it wrote so far into $OUT
    for _ in $(seq $(( ${2:-540} / 5 ))); do [ -f $RES/DONE ] && break; sleep 5; done
    tar -czf "$OUT/res.tgz" -C $RES .; cat $RES/steps.txt; grep -h "^RESULT" $RES/*.log | cut -c1-300
    grep -h "Error\|Traceback" $RES/*.log | sort | uniq -c | sort -rn | head -20 | cut -c1-300 ;;
  *) sed -n 2,25p "$0"; exit 2 ;;
esac
