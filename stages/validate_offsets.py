"""Stage `validate_offsets`: prove the serving engine feeds the draft exactly the stored features.

Usage: python stages/validate_offsets.py TARGET_DIR FEATURES_DIR OK_JSON METRICS_JSON REPORT_JSON COSINE_CSV
UNQUANTIZED_DIR
Reads params `layers`, `framework`, `validate`. Captures `validate.samples` stored sequences through the
`framework` engine (quantized as `validate.quantization` says; with `validate.reference` also unquantized, the
baseline a numerics gap is measured against; a pre-quantized target's baseline is its float release in
UNQUANTIZED_DIR, `target.unquantized`, when given) with the ids the exporter writes (± `validate.search`), writes
REPORT_JSON (every cosine), METRICS_JSON (verdict, worst cosine, offset per layer) and the cosine table
COSINE_CSV (a heatmap in `dvc plots show`), and exits 1 with an actionable message on mismatch.
OK_JSON (the gate token training depends on) is written only when the check passes.
"""

import logging
import sys
from pathlib import Path

import pandas as pd

from eaglepipe.atomic import atomic_write_json
from eaglepipe.contract.validate import check_offsets, reference_capture, require_ok
from eaglepipe.data.features import FeatureSet
from eaglepipe.engines import get_engine
from eaglepipe.serving.servable import require_servable
from eaglepipe.stage import require_inputs, run, start, write_metrics
from eaglepipe.target.checkpoint_quant import checkpoint_scheme
from eaglepipe.target.config import has_config
from eaglepipe.target.info import read_info

log = logging.getLogger("validate_offsets")


def main():
    p = start("validate_offsets")
    target_dir, features_dir, ok_json, metrics, report_json, cosine_csv, unquantized = map(Path, sys.argv[1:8])
    require_inputs(target_dir, features_dir, unquantized)
    fs = FeatureSet(features_dir)
    fs.require_layers(p.layers)
    info = read_info(target_dir, hash_weights=False)
    family = info.family
    require_servable(p.framework, family, info.n_layers, p.layers)  # exit 2, nearest lists named, before capture
    v, samples, ref = p.validate_, fs.take(p.validate_.samples), None
    # the baseline a numerics gap is measured against, served by the same engine unquantized: a pre-quantized
    # target's float release, else with validate.quantization the target itself
    baseline, what = ((unquantized, "float release (target.unquantized)") if has_config(unquantized) else
                      (target_dir, "unquantized") if v.quantization and v.reference else (None, None))
    if baseline:
        with get_engine(p.framework, baseline, dtype=v.engine_dtype, info=read_info(baseline, hash_weights=False),
                        tensor_parallel_size=p.tensor_parallel_size, expert_parallel=p.expert_parallel) as engine:
            ref = reference_capture(engine, family, fs.n_layers, fs.layers, samples, what)
    with get_engine(p.framework, target_dir, dtype=v.engine_dtype, info=info, quantization=v.quantization,
                    tensor_parallel_size=p.tensor_parallel_size, expert_parallel=p.expert_parallel) as engine:
        rep = check_offsets(engine, family, fs.n_layers, fs.layers, samples, v.search, v.min_cosine,
                            v.max_rel_l2, ref, v.min_match_cosine)
    rep.checkpoint = (checkpoint_scheme(target_dir) or {}).get("name")
    if note := rep.gap_note():
        log.info(note)
    write_metrics(report_json, rep.to_json())
    write_metrics(metrics, rep.compact())
    cosine_csv.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rep.table()).to_csv(cosine_csv, index=False)
    require_ok(rep)
    atomic_write_json(ok_json, {"features_run_key": fs.manifest["run_key"], "layers": fs.layers})


if __name__ == "__main__":
    run(main)
