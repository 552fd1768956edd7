#!/usr/bin/env bash
# HERE: rebuild benchmarks/h200/scaling.csv and scaling.png from every committed run (issue 13's curve).
# One line per source: the subset runs (scaling/), each full run's train report, then each kept draft's served,
# reference or simulated τ (benchmarks/scaling.py csv --served ENGINE:KEY[/MLP]:FILE[#a.b]). Add a run here
# when it lands, so the curve is one command.
set -euo pipefail
cd "$(dirname "$0")/../.."
h=benchmarks/h200
python benchmarks/scaling.py csv --runs $h/scaling \
  --train-report $h/draft16k/train.json $h/draft16k_2turns/train.json $h/draft_synth16k/train.json \
    $h/draft_synth16k_wide/train.json $h/draft_synth32k_wide/train.json \
  --served \
    vllm:4096:$h/serve_vllm_draft4096.json \
    vllm:3989098:$h/serve_vllm_draft16k.json \
    sim_mtbench:3989098:$h/draft16k/sim_gap_mtbench.json \
    vllm:6309909:$h/serve_vllm_draft16k_2turns.json \
    sglang:6309909:$h/serve_sglang_draft16k_2turns.json \
    sim_mtbench:6309909:$h/draft16k_2turns/sim_gap_mtbench.json \
    sim_mtbench:7641948/1536:$h/draft_synth16k/sim_gap_mtbench.json \
    sim_mtbench:7641948/6144:$h/draft_synth16k_wide/sim_gap_mtbench.json \
    vllm:7641948/6144:$h/serve_vllm_draft_bfloat16_synth16k_wide.json \
    sglang:7641948/6144:$h/serve_sglang_draft_synth16k_wide.json \
    sim_mtbench:11289193/6144:$h/draft_synth32k_wide/sim_gap_mtbench.json \
    ${SCALING_EXTRA:-} > /dev/null
python benchmarks/scaling.py render
