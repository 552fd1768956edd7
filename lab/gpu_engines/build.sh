#!/usr/bin/env bash
# Build the carry parts that bring vLLM 0.26.0 (stage "vllm") and SGLang 0.5.17 (stage "sglang") onto the
# lent H200 (py3.12, torch 2.11.0+cu130, no network). Runs HERE (CPU machine with PyPI), from the repo root
# of the checkout whose working tree the device `run` sends. Output lives in the git-ignored .gpu/:
#   .gpu/wheels/<stage>/   downloaded wheels (--no-deps, exact pins from wheels-<stage>.txt)
#   .gpu/stage/<stage>/    the stage payload before splitting
#   .gpu/carry/NN/         one folder per device call, each holding one part (<= 48 MiB): carry ".gpu/carry/NN"
#   .gpu/carry/MANIFEST.sha256 and .gpu/carry/NN/MANIFEST.sha256 (copied into every call folder)
#   .gpu/carry/cNN/        one folder per device call: up to CALL_MB of parts of any stage + MANIFEST.sha256
# Usage: lab/gpu_engines/build.sh [vllm|sglang|inputs|all]   (default all)
#   inputs = what lab/h200_engines.py serves and extracts: the SmolLM2 GGUF, the draft of this
#   checkout's data/drafter (whose export under data/export must hold the same weights), data/prompts;
#   data = the GPU profile's sources for lab/gpu_run.sh: the bundled ShareGPT file (xz), HumanEval, MT-bench.
# Env: PART_MB (default 20), CALL_MB (default 60), XZ_OPTS (default "-T1 -6"), WITH_FA3=1 keeps
#   sgl_kernel/flash_ops (1.1 GB, see lab/README.md)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
HERE=lab/gpu_engines
STAGES=${1:-all}; [ "$STAGES" = all ] && STAGES="vllm sglang inputs data"
PART_MB=${PART_MB:-20}
CALL_MB=${CALL_MB:-60}
XZ_OPTS=${XZ_OPTS:-"-T1 -6"}
G=.gpu
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
 --platform manylinux_2_26_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64
 --platform manylinux_2_35_x86_64"
PY=${PYTHON:-python3}

download() {  # $1 = stage
  local list=$HERE/wheels-$1.txt dir=$G/wheels/$1
  mkdir -p "$dir"
  # shellcheck disable=SC2046
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
      -d "$dir" $(grep -vE '^\s*(#|$)' "$list") 2>&1 | grep -v '^WARNING: Location' || true
  # exactly one wheel per pinned line, nothing stale
  local want have
  want=$(grep -vcE '^\s*(#|$)' "$list"); have=$(ls "$dir"/*.whl | wc -l)
  [ "$want" = "$have" ] || { echo "stage $1: $want pins but $have wheels in $dir (stale or missing?)" >&2; exit 1; }
}

tree_xz() {  # $1 wheel, $2 output .tar.xz, rest: unzip -x exclude patterns.  Unpacked wheel = site-packages layout.
  local whl=$1 out=$2; shift 2
  local t; t=$(mktemp -d "$G/tmp.XXXX")
  unzip -q "$whl" -d "$t" -x "$@"
  echo "  unpacked after pruning: $(du -sm "$t" | cut -f1) MiB"
  tar -C "$t" -cf - . | xz $XZ_OPTS > "$out"
  rm -rf "$t"
}

build_stage() {  # $1 = stage
  local s=$1 st=$G/stage/$1
  echo "== stage $s"
  rm -rf "$st"; mkdir -p "$st/wheels"
  case $s in inputs|data) ;; *) download "$s" ;; esac
  case $s in
    inputs)
      local w=data/drafter/model.safetensors
      rmdir "$st/wheels"
      cp -L bundled/SmolLM2-135M-Instruct.Q4_1.gguf "$st/"
      # The CPU draft and prompts serve only h200_engines.py's serve/extract/validate steps; the GPU profile's
      # draft-* steps (gpu_run.sh) need the GGUF alone, so a checkout that has not run `dvc repro` packs just it.
      if [ ! -f "$w" ]; then echo "  no $w (dvc repro not run): inputs = the GGUF only (enough for draft-*)"
      else
        for e in vllm sglang; do
          cmp -s "$w" data/export/$e/model.safetensors || { echo "data/export/$e holds other weights than $w: dvc repro first" >&2; exit 1; }
        done
        mkdir -p "$st/draft" "$st/prompts"
        cp "$w" "$st/draft/"; cp data/drafter/config.json "$st/draft/drafter.json"
        cp data/export/vllm/config.json "$st/draft/vllm.json"; cp data/export/sglang/config.json "$st/draft/sglang.json"
        cp data/prompts/train.jsonl data/prompts/eval.jsonl "$st/prompts/"
      fi
      ;;
    data)  # the GPU profile's sources (lab/gpu_run.sh puts them where eaglepipe's bundled/ links look)
      rmdir "$st/wheels"
      xz $XZ_OPTS -c bundled/ShareGPT_V3_unfiltered_cleaned_split.json > "$st/ShareGPT_V3_unfiltered_cleaned_split.json.xz"
      cp -L bundled/HumanEval.jsonl.gz "$st/"; cp -L bundled/mt_bench_question.jsonl "$st/question.jsonl"
      ;;
    vllm)
      # runtime-notes: drop FA2 (305 MB unpacked), the Rust front end, Blackwell fmha, DeepGEMM headers.
      # Keep _vllm_fa3_C (model inspection imports vllm_flash_attn unconditionally).
      tree_xz $G/wheels/vllm/vllm-0.26.0-*.whl "$st/vllm-tree.tar.xz" \
        'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs' \
        'vllm/third_party/fmha_sm100/*' 'vllm/third_party/deep_gemm/include/*'
      for w in $G/wheels/vllm/*.whl; do case $w in */vllm-0.26.0-*) ;; *) cp "$w" "$st/wheels/";; esac; done
      ;;
    sglang)
      # sgl_kernel layout (0.4.5): sm90/common_ops.abi3.so and sm100/common_ops.abi3.so picked at import by
      # compute capability (load_utils.py: cc 90 -> sm90). Drop sm100/. flash_ops.abi3.so (FA3, 1.1 GB
      # unpacked, one fat binary, not splittable by arch without CUDA tools) is imported only by
      # sgl_kernel/flash_attn.py (fa3 backend): dropped unless WITH_FA3=1 -> use attention_backend="triton".
      # infllm_ops (InfLLM-V2 sparse attention) is loaded lazily: dropped.
      local ex=('sgl_kernel/sm100/*' 'sgl_kernel/infllm_ops*.so')
      [ "${WITH_FA3:-0}" = 1 ] || ex+=('sgl_kernel/flash_ops.abi3.so')
      tree_xz $G/wheels/sglang/sglang_kernel-0.4.5-*.whl "$st/sgl-kernel-tree.tar.xz" "${ex[@]}"
      for w in $G/wheels/sglang/*.whl; do case $w in */sglang_kernel-*) ;; *) cp "$w" "$st/wheels/";; esac; done
      ;;
  esac
  # one stream per stage: tar (no compression: wheels are zips, the tree is already xz)
  local bundle=$G/stage/$s.tar
  tar -C "$st" -cf "$bundle" .
  # split into parts; pack_calls below fills call folders with them, stage after stage
  split -b "${PART_MB}M" -d -a 2 "$bundle" "$G/parts/$s.tar.part"
  (cd $G/stage && sha256sum "$s.tar") >> $G/carry/MANIFEST.sha256
}

pack_calls() {  # parts in stage order → .gpu/carry/c01, c02, ... each at most CALL_MB
  local i=1 used=0 d sz
  for s in $STAGES; do for p in $G/parts/$s.tar.part*; do
    sz=$(stat -c %s "$p")
    if [ $((used + sz)) -gt $((CALL_MB * 1048576)) ]; then i=$((i+1)); used=0; fi
    d=$(printf '%s/carry/c%02d' $G $i); mkdir -p "$d"; mv "$p" "$d/"; used=$((used + sz))
  done; done
}

rm -rf $G/carry $G/stage $G/parts; mkdir -p $G/carry $G/stage $G/parts
: > $G/carry/MANIFEST.sha256
for s in $STAGES; do build_stage "$s"; done
pack_calls
# per-part sums; every call folder carries the full manifest (small) so any call can check what it has
for d in $G/carry/c[0-9][0-9]; do (cd "$d" && sha256sum ./*.part*) | sed 's#  \./#  #' >> $G/carry/MANIFEST.sha256; done
for d in $G/carry/c[0-9][0-9]; do cp $G/carry/MANIFEST.sha256 "$d/"; done
echo "== manifest"; cat $G/carry/MANIFEST.sha256
echo "== calls (carry one folder each)"
for d in $G/carry/c[0-9][0-9]; do echo "$d $(du -cb "$d"/* | tail -1 | cut -f1) bytes: $(ls "$d" | grep -v MANIFEST)"; done
echo "== inner payload"; ls -l $G/stage/*/ $G/stage/*/wheels | grep -v '^total'
