"""τ_sim on the serving prompts: does the gap between a draft's τ_sim and its served τ come from the data or from
serving? (issue 13: the H200 draft's τ_sim 2.443 on held-out ShareGPT against vLLM's 1.967 on MT-bench)

    python benchmarks/sim_gap.py --target data/target --drafter data/drafter --out benchmarks/sim_gap_cpu.json
    python benchmarks/sim_gap.py ... --source humaneval --n 164        # the second serving benchmark
    python benchmarks/sim_gap.py ... --reference                       # + the reference decoder's served τ there

For each prompt (MT-bench first turns, or HumanEval, as serve_eval forms them):
the target's greedy continuation (transformers, fp32), its boundary states captured as extract captures them
(:meth:`eaglepipe.engines.hf.HFEngine.capture`, the draft's layers + [N], cast to ``--store-dtype`` as the
training store was), then the held-out evaluation train_drafter runs every epoch (the same TTT unroll, fp32
teacher, top-1-in-vocabulary mask) with the loss mask on the continuation only. Read the result as:
  - τ_sim here ≈ served τ on the same prompts, both below the training τ_sim: the data (the serving prompts
    are out of the training distribution);
  - τ_sim here ≈ the training τ_sim, served τ below it: serving feeds the draft something else than training did.
(τ_sim multiplies per-step accuracies as if independent; on the CPU defaults it matched served τ to 0.001.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eaglepipe.data.features import FeatureSample, store_capture  # noqa: E402
from eaglepipe.data.prompts import humaneval_prompts, mtbench_first_turns  # noqa: E402
from eaglepipe.engines.hf import HFEngine  # noqa: E402
from eaglepipe.model.draft import CONFIG_FILE, load_draft  # noqa: E402
from eaglepipe.model.target_head import load_target_head, soft_targets  # noqa: E402
from eaglepipe.params import TrainParams  # noqa: E402
from eaglepipe.serving.evaluate import eval_prompts, reference_eval  # noqa: E402
from eaglepipe.train.distributed import autocast_for  # noqa: E402
from eaglepipe.train.evaluation import eval_summary  # noqa: E402
from eaglepipe.train.packing import collate, pack  # noqa: E402
from eaglepipe.train.ttt import ttt_unroll  # noqa: E402


def samples_on(engine: HFEngine, prompts: list[dict], ids: list[int], max_new: int, dtype: str) -> list[FeatureSample]:
    """Greedy continuations of ``prompts`` and their captured states: FeatureSample per prompt, loss on the
    continuation (input_ids (T,) int64, loss_mask (T,) bool, aux (T, L, H), last (T, H) in ``dtype``)."""
    outs = engine.generate([p["input_ids"] for p in prompts], max_new)
    seqs = [p["input_ids"] + o for p, o in zip(prompts, outs)]
    caps = engine.capture(seqs, ids)  # (T, L+1, H) float32 each
    out = []
    for p, o, s, h in zip(prompts, outs, seqs, caps):
        mask = torch.zeros(len(s), dtype=torch.bool)  # over predictions (eaglepipe/data/template.py): position t
        mask[len(p["input_ids"]) - 1 : -1] = True      # scores token t + 1, here every continuation token
        out.append(FeatureSample(p["id"], torch.tensor(s), mask, *store_capture(h, dtype)))
    return out


def simulator(drafter_dir: Path, target_dir: Path, steps: int, decay: float, max_tokens: int):
    """The draft and the target head loaded once; returns ``simulate(samples) -> dict``: train_drafter's held-out
    evaluation (eaglepipe/train/evaluation.py::evaluate: the fp32 teacher, bf16 autocast on CUDA,
    :func:`eaglepipe.train.evaluation.eval_summary`) over ``samples``: acc per TTT step, τ_sim, counted positions."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    draft = load_draft(drafter_dir, dev).float()
    head = load_target_head(target_dir).to(dev)

    @torch.inference_mode()
    def simulate(samples: list[FeatureSample]) -> dict:
        def results():
            for row in pack([len(s.input_ids) for s in samples], list(range(len(samples))), max_tokens):
                b = collate([samples[i] for i in row]).to(dev)
                soft = soft_targets(head, b.last, draft.t2d)
                with autocast_for(dev):
                    yield ttt_unroll(draft, head.embed, b, soft, steps, decay)

        ev = eval_summary(results(), steps)
        return {"acc": [round(a, 4) for a in ev["acc"]], "tau_sim": round(ev["tau_sim"], 4),
                "positions": ev["positions"]}

    return simulate


def sim(drafter_dir: Path, target_dir: Path, samples: list[FeatureSample], steps: int, decay: float,
        max_tokens: int) -> dict:
    """:func:`simulator` over one set of ``samples``."""
    return simulator(drafter_dir, target_dir, steps, decay, max_tokens)(samples)


def by_category(records: list[dict], samples: list[FeatureSample], simulate) -> dict:
    """τ_sim and per-step accuracy for each MT-bench category (records' ``category``; {} where there is none),
    ``simulate`` = :func:`simulator`'s function, over each subset: which kinds of prompt the draft has not learnt."""
    cat = {r["id"]: r.get("category") for r in records}
    groups: dict[str, list[FeatureSample]] = {}
    for s in samples:
        if cat.get(s.id):
            groups.setdefault(cat[s.id], []).append(s)
    return {c: {"prompts": len(ss), **simulate(ss)} for c, ss in sorted(groups.items())}


def _served(target: Path, drafter: Path, layers: list[int], prompts: list[dict], k: int, max_new: int) -> dict:
    """The reference decoder (eaglepipe.serving.evaluate.reference_eval, fp32) on the same prompts: τ, acceptance per
    position, outputs equal to greedy."""
    r = reference_eval(target, drafter, layers, prompts, k, max_new)
    return {"tau": round(r["tau"], 4), "acceptance_per_pos": [round(a, 4) for a in r["acceptance_per_pos"]],
            "outputs_equal": r["outputs_equal"], "prompts_equal": r["prompts_equal"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True, help="train_drafter's output folder (data/drafter)")
    ap.add_argument("--source", default="mtbench", choices=["mtbench", "humaneval"])
    ap.add_argument("--n", type=int, default=80)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--store-dtype", default="bfloat16", help="extract.dtype of the training store")
    ap.add_argument("--ttt", type=int, default=3, help="train.ttt_steps the draft was trained with")
    ap.add_argument("--reference", action="store_true",
                    help="also serve the prompts with the reference decoder (k = --ttt): served τ beside τ_sim")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    target, drafter = Path(a.target), Path(a.drafter)
    cfg = json.loads((drafter / CONFIG_FILE).read_text())  # save_draft's extra: layers, best_tau_sim
    p = TrainParams(ttt_steps=a.ttt)
    steps, decay, max_tokens = p.ttt_steps, p.step_decay, p.batch_tokens
    t0 = time.perf_counter()
    engine = HFEngine(target, dtype="float32")
    records = mtbench_first_turns() if a.source == "mtbench" else humaneval_prompts(a.n)
    prompts = eval_prompts(engine.tokenizer, records, a.n)
    layers = cfg["layers"]
    samples = samples_on(engine, prompts, layers + [engine.n_layers], a.max_new, a.store_dtype)
    engine.close()
    simulate = simulator(drafter, target, steps, decay, max_tokens)
    res = {"source": a.source, "prompts": len(prompts), "max_new_tokens": a.max_new, "layers": layers,
           "store_dtype": a.store_dtype, "ttt_steps": steps, "training_tau_sim": cfg.get("best_tau_sim"),
           **simulate(samples), "by_category": by_category(records, samples, simulate),
           **({"reference": _served(target, drafter, layers, prompts, steps, a.max_new)} if a.reference else {}),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "seconds": round(time.perf_counter() - t0, 1)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print("RESULT sim_gap " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
