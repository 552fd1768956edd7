"""Stage `extract`: the target's aux hidden states h[k] (k in `layers`) and h[N] for every training token.

Usage: python stages/extract.py TARGET_DIR TRAIN_JSONL OUT_DIR METRICS_JSON
Reads params `layers`, `extract`; writes OUT_DIR (shards + manifest.json, see eaglepipe/data/features.py) and
METRICS_JSON. Killed and restarted, it resumes from the finished shards (scratch under data/.scratch/, keyed
by params, target, prompts and the eaglepipe code, so shards written by other code are never resumed).
With `extract.store: tokens` (online training) it stores token ids, loss masks and the regenerated text,
and features only for the first `validate.samples` samples (the offset gate's), so it reads `validate.samples`.
Reads `framework` only to refuse, before any compute, a layer list that engine cannot express (the shards do
not depend on it, so it is not among extract's params in dvc.yaml).
Replicas: with `extract.nproc_per_node` N > 1 it re-launches itself as `torchrun --standalone --nproc_per_node N`
with the same arguments; under torchrun (that, or one `torchrun --nnodes H ...` per host, docs/cluster.md) each
rank extracts its shards and rank 0 writes OUT_DIR and METRICS_JSON (eaglepipe/data/distributed_extract.py).
With `extract.engine: hf` and `tensor_parallel_size` T > 1 it re-launches itself as T torchrun ranks forming one hf
replica (transformers' own tensor parallelism, one GPU or core share per rank).
"""

import hashlib
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from eaglepipe.data.distributed_extract import Replica, place, process_group, relaunch
from eaglepipe.data.extract import extract
from eaglepipe.data.prompts import read_jsonl
from eaglepipe.engines.hf import check_tensor_parallel
from eaglepipe.host import Layout
from eaglepipe.params import check_layers_against_target
from eaglepipe.serving.servable import require_servable
from eaglepipe.stage import require_inputs, run, scratch_dir_of, start, write_metrics
from eaglepipe.target.info import read_info


def main():
    p = start("extract")
    target_dir, train_file, out_dir, metrics = map(Path, sys.argv[1:5])
    require_inputs(target_dir, train_file)
    info = read_info(target_dir, hash_weights=False)  # the checks need its config only
    check_layers_against_target(p.layers, info.n_layers)
    # Before any compute: a layer list the serving engine cannot express stops here (exit 2); one the other
    # engine cannot express is logged with the nearest lists that work (export then writes no folder for it).
    for plan in require_servable(p.framework, info.family, info.n_layers, p.layers).values():
        if plan.ids is None:
            logging.getLogger("extract").warning("%s", plan.message(p.layers, info.n_layers))
    layout = Layout.of(p.extract.engine, p.extract.nproc_per_node, p.tensor_parallel_size)
    if layout.tp > 1:
        check_tensor_parallel(target_dir, layout.tp)  # a family transformers cannot shard stops here (exit 2)
    replica = Replica.from_env(tp=layout.tp)
    if replica.world == 1 and layout.procs > 1:
        relaunch(layout.procs, layout.devices, tp=layout.tp)  # does not return: this process becomes torchrun
    place(replica, layout.devices, p.extract.workers)  # this rank's GPUs (or cores), before any engine
    info = read_info(target_dir)  # with the weights' hash, which keys the shards
    prompts_hash = hashlib.sha256(train_file.read_bytes()).hexdigest()[:16]
    with process_group(replica):
        done = extract(read_jsonl(train_file), target_dir, info, p.layers, p.extract, out_dir,
                       scratch_dir_of(out_dir), prompts_hash, gate_samples=p.validate_.samples,
                       tensor_parallel_size=p.tensor_parallel_size, replica=replica,
                       expert_parallel=p.expert_parallel)
    if done is None:  # a rank other than 0: rank 0 wrote the store
        return
    manifest, stats = done
    write_metrics(metrics, {"engine": manifest["engine"], "engine_version": manifest["engine_version"],
                            "layers": p.layers, "dtype": p.extract.dtype, "store": p.extract.store, **asdict(stats)})


if __name__ == "__main__":
    run(main)
