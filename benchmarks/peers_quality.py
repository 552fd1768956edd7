"""Drafts of eaglepipe's recipe against speculators 0.9.0's, trained on the same features, judged the same way.

    python benchmarks/peers_quality.py --target data/target --features data/features \\
        --peer-path /tmp/peers --out benchmarks/peers_quality_cpu.json            # after `dvc repro` (CPU-sized)
    python benchmarks/peers_quality.py ... --profile profiles/gpu.yaml --mtbench 80 --humaneval 164 --max-new 128 \
        --judge-workers 12 --out benchmarks/peers_quality.json                  # the GPU run
    ... --phase train --recipes speculators; ... --phase judge                  # the same in parts (--work kept)

One features store (extract's output, ``extract.store: features``), one split: train_drafter's own
(``train.eval_fraction`` held out by :func:`eaglepipe.train.packing.split_samples`); every recipe trains for
``--epochs`` epochs on the train part and may use the held-out part to choose its kept weights. Recipes:

- ``eaglepipe``: ``train_drafter`` with params.yaml's ``train`` section (``--set train.key=value`` to ablate).
- ``speculators``: speculators 0.9.0's own draft (``speculators.train.cli.build_draft_model`` from its
  ``TrainConfig`` defaults: EAGLE-3.1 norms, kl_div loss, ttt_step_loss_decay 1.0, Muon + AdamW at lr 1e-3,
  linear schedule, 8,192-token packed rows), its vocabulary mapping (``build_vocab_mappings_from_distribution`` over
  the assistant tokens' frequencies, as its preprocessing counts them, at eaglepipe's ``draft_vocab_size``), its
  sampler and collate (``_setup_dataloader`` with ``shift_batch``) and its ``Trainer``. Only the data is
  converted: a stored sample becomes its sample dict (``hidden_states`` = the aux states concatenated,
  ``verifier_last_hidden_states`` = h[N], ``loss_mask`` = eaglepipe's shifted right by one, since speculators
  marks assistant tokens and eaglepipe the positions predicting one). On CPU its Trainer cannot run (it moves
  the model and batches to ``local_rank``, a CUDA device: speculators/train/trainer.py ``setup_model``,
  ``train_epoch``), so there the same step sequence runs in :func:`cpu_train` (its forward under bf16 autocast,
  clip 1.0, its optimizers and schedulers), with its CPU-capable choices: ``draft_attn_impl`` sdpa and the eager
  loss (flex attention has no CPU backward, the fused loss is Triton). On CUDA (torch 2.11) its fused loss fails
  inside its own torch.compile'd forward, so it runs outside the graph (``torch.compiler.disable``), as it
  computes. Its last epoch is kept (``save_best`` is off by default).
  The trained weights are copied into eaglepipe's draft (``layers.0.*`` → ``midlayer.*``, the same EAGLE-3.1
  flags) and the copy is checked: one forward of both on a held-out sample must give the same logits.

Judge: the reference decoder (:func:`eaglepipe.serving.evaluate.reference_eval`: the fp32 target, the draft
chaining ``--k`` tokens greedily, outputs checked equal to greedy decoding) on the first ``--mtbench`` MT-bench
first turns and ``--humaneval`` HumanEval prompts, ``--max-new`` tokens each. One row per recipe and benchmark:
``{recipe, machine, conversations, epochs, train_tokens, train_s, judge, benchmark, tau,
acceptance_per_position}`` (plus the recipe's settings), appended to ``--out`` (rows of the same recipe,
benchmark and machine replaced). Greedy decoding runs once per prompt for all drafts judged together; the prompts
are split over ``--judge-workers`` processes. ``--phase train`` keeps each draft in ``--work`` with its
``peers_info.json``; ``--phase judge`` judges every draft kept there.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eaglepipe.data.features import FeatureSet  # noqa: E402
from eaglepipe.data.prompts import humaneval_prompts, mtbench_first_turns  # noqa: E402
from eaglepipe.model.draft import NORMS, DraftConfig, Eagle3Draft, save_draft  # noqa: E402
from eaglepipe.params import TrainParams  # noqa: E402
from eaglepipe.serving.evaluate import eval_prompts  # noqa: E402
from eaglepipe.target.config import read_target_config  # noqa: E402
from eaglepipe.train.packing import split_samples  # noqa: E402


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"


def train_params(params: Path, profile: Path | None, sets: list[str], epochs: int) -> TrainParams:
    """params.yaml's ``train`` section with ``profile`` merged over it, then ``--set`` applied, and ``epochs``."""
    import yaml

    from eaglepipe.params import parse_params
    from eaglepipe.profiles import apply_sets, merge_profile

    raw = yaml.safe_load(params.read_text())
    if profile is not None:
        merge_profile(raw, yaml.safe_load(profile.read_text()))
    p = parse_params(apply_sets(raw, sets)).train
    return p.model_copy(update={"epochs": epochs})


# ---------------------------------------------------------------- eaglepipe


def eaglepipe_recipe(a, p: TrainParams, work: Path, out: Path) -> dict:
    from eaglepipe.train.loop import train_drafter

    shutil.rmtree(work / "scratch-eaglepipe", ignore_errors=True)
    s = train_drafter(a.features, a.target, out, p, scratch_dir=work / "scratch-eaglepipe")
    return {"train_tokens": s["train_tokens"], "train_s": s["seconds"], "kept_epoch": s["best"]["epoch"] + 1,
            "settings": {"set": a.set}, "tau_sim": {e: v["tau_sim"] for e, v in s["evals"].items()}}


# ---------------------------------------------------------------- speculators 0.9.0


def to_speculators(sample) -> dict:
    """An eaglepipe FeatureSample → speculators' sample dict (speculators/train/data.py create_empty_sample)."""
    T = len(sample.input_ids)
    mask = torch.zeros(T, dtype=torch.bool)
    mask[1:] = sample.loss_mask[:-1]  # speculators: token t is assistant text; eaglepipe: token t+1 is
    return {"input_ids": sample.input_ids, "hidden_states": sample.aux.flatten(-2), "loss_mask": mask,
            "verifier_last_hidden_states": sample.last, "lengths": torch.tensor([T]),
            "position_ids": torch.arange(T)}


class SampleList(torch.utils.data.Dataset):
    """Sample dicts in memory, with the two attributes speculators' ``_setup_dataloader`` reads."""

    def __init__(self, samples: list[dict], dtype: torch.dtype):
        self.samples, self.hidden_states_dtype = samples, dtype
        self.approx_lengths = [len(s["input_ids"]) for s in samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return self.samples[i]


def speculators_args(a, p: TrainParams, layers: list[int], work: Path, cuda: bool):
    """Its TrainConfig defaults (derived defaults resolved by its schema), as its CLI flattens them."""
    from speculators.train.config import TrainConfig

    args = argparse.Namespace(**TrainConfig().flatten())
    args.verifier_name_or_path = str(a.target)
    args.draft_vocab_size = p.draft_vocab_size
    args.target_layer_ids = layers
    args.epochs = a.epochs
    args.save_path = str(work / "speculators-checkpoints")
    args.data_path = str(work)
    if not cuda:
        args.draft_attn_impl, args.loss_implementation = "sdpa", "eager"
    for kv in a.spec_set:  # an ablation of its defaults, e.g. total_seq_len=2048
        key, _, value = kv.partition("=")
        old = getattr(args, key)
        setattr(args, key, type(old)(value) if old is not None and not isinstance(old, bool) else json.loads(value))
    return args


def speculators_recipe(a, p: TrainParams, work: Path, out: Path) -> dict:
    from train_step import install_stubs  # openai, datasets, hs_connectors: imported, never run here

    install_stubs()
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import build_draft_model, set_seed
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.trainer import Trainer, TrainerConfig
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    cuda = torch.cuda.is_available()
    fs = FeatureSet(a.features)
    train, held = split_samples(fs.refs, p.eval_fraction, p.seed)
    data = {name: [to_speculators(fs.read(r)) for r in refs] for name, refs in (("train", train), ("val", held))}
    freq: dict[int, int] = {}
    for s in data["train"]:  # its save_token_frequency_distribution's count: tokens under its loss_mask
        for t, c in zip(*s["input_ids"][s["loss_mask"]].unique(return_counts=True)):
            freq[int(t)] = freq.get(int(t), 0) + int(c)
    vocab_size = read_target_config(a.target)["vocab_size"]
    d2t, t2d = build_vocab_mappings_from_distribution(freq, p.draft_vocab_size, vocab_size)
    args = speculators_args(a, p, fs.layers, work, cuda)
    shutil.rmtree(args.save_path, ignore_errors=True)
    set_seed(args.seed)
    model = build_draft_model(args, Eagle3DraftModel, t2d, d2t, p.draft_vocab_size)
    H, dtype = model.config.transformer_layer_config.hidden_size, getattr(torch, args.hidden_states_dtype)
    loaders = [_setup_dataloader(SampleList(data[n], dtype), args.total_seq_len, H, num_workers=0,
                                 num_target_layers=len(fs.layers), preprocess=shift_batch, seed=args.seed)
               for n in ("train", "val")]
    train_kw, val_kw = Eagle3DraftModel.get_trainer_kwargs(**vars(args))
    if cuda:  # its fused Triton KL fails inside its own torch.compile on torch 2.11: run it outside the graph
        for kw in (train_kw, val_kw):
            kw["loss_config"] = {n: (torch.compiler.disable(f), w) for n, (f, w) in kw["loss_config"].items()}
    tc = TrainerConfig(num_epochs=args.epochs, save_path=args.save_path, lr=args.lr, train_call_kwargs=train_kw,
                       val_call_kwargs=val_kw, optimizer=args.optimizer, weight_decay=args.weight_decay,
                       muon_lr=args.muon_lr, muon_momentum=args.muon_momentum,
                       muon_weight_decay=args.muon_weight_decay, muon_ns_steps=args.muon_ns_steps,
                       muon_adjust_lr_fn=args.muon_adjust_lr_fn, scheduler_type=args.scheduler_type,
                       hidden_states_dtype=dtype, log_freq=10**9)
    t0 = time.perf_counter()
    if cuda:
        Trainer(model, tc, *loaders).run_training()
    else:
        cpu_train(model, tc, loaders[0])
    train_s = time.perf_counter() - t0
    tokens = a.epochs * sum(len(s["input_ids"]) for s in data["train"])
    to_eaglepipe(model.cpu().float(), p, fs, a.target, out, data["val"][0])
    keys = ("optimizer", "lr", "loss_fn", "ttt_step_loss_decay", "total_seq_len", "scheduler_type",
            "norm_before_fc", "norm_before_residual", "norm_output", "draft_attn_impl", "loss_implementation")
    return {"train_tokens": tokens, "train_s": round(train_s, 1), "kept_epoch": a.epochs,
                 "settings": {k: getattr(args, k) for k in keys}}


def cpu_train(model, tc, loader) -> None:
    """speculators' Trainer.train_epoch step sequence (trainer.py) on the CPU: forward under autocast, zero_grad,
    backward, clip_grad_norm_ 1.0, its optimizers' and schedulers' steps."""
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import _resolve_scheduler_steps
    from transformers import get_linear_schedule_with_warmup

    model.train()
    opts = build_optimizers(model, tc)
    warm, total = _resolve_scheduler_steps(tc, len(loader))
    scheds = [get_linear_schedule_with_warmup(o, warm, total) for o in opts]
    for epoch in range(tc.num_epochs):
        for batch in loader:
            batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
            with torch.autocast("cpu", dtype=tc.hidden_states_dtype):
                _, loss, _ = model(**batch, **tc.train_call_kwargs)
            for o in opts:
                o.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for o in opts:
                o.step()
            for s in scheds:
                s.step()
        print(f"speculators epoch {epoch}: last loss {loss.item():.4f}", flush=True)


def to_eaglepipe(model, p: TrainParams, fs: FeatureSet, target: Path, out: Path, check: dict) -> None:
    """Copy its trained draft into eaglepipe's (same architecture and flags) and save it; raise AssertionError
    when one forward of both on ``check`` (a speculators sample) disagrees."""
    from eaglepipe.model.draft import KVCache, draft_step

    c = model.config
    assert not c.fc_norm, "fc_norm: not a speculators default; the check below reads input_norm only"
    cfg = DraftConfig.from_target(read_target_config(target), len(fs.layers), p.draft_vocab_size,
                                  norms=[k for k in NORMS if getattr(c, k)])  # its flags have the engines' names
    draft = Eagle3Draft(cfg)
    theirs = model.state_dict()
    mine = {k.replace("layers.0.", "midlayer."): v for k, v in theirs.items()
            if not k.startswith(("embed_tokens", "verifier_"))}
    draft.load_state_dict(mine, strict=True)
    save_draft(draft, out, {"layers": fs.layers, "recipe": "speculators"})
    # the check: the first draft step (aux → logits) of both, fp32
    ids, hs = check["input_ids"][None], check["hidden_states"][None].float()
    T = ids.shape[1]
    model.layers[0].self_attn.config._attn_implementation = "eager"  # a float causal mask, on any device
    with torch.no_grad():
        h = model.fc(model.input_norm(hs) if model.input_norm is not None else hs)
        x = torch.cat([model.embed_tokens(ids), h], -1)
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = model.layers[0](x, attention_mask=mask, position_ids=pos,
                            position_embeddings=model.rotary_emb(x, pos))
        theirs_logits = model.lm_head(model.norm(y))
        st = draft_step(draft, model.embed_tokens.weight, ids, pos, KVCache(), aux=check["hidden_states"][None]
                        .float().view(1, T, len(fs.layers), -1))
        mine_logits = st.logits[..., draft.d2t + torch.arange(cfg.draft_vocab_size)]
    err = ((mine_logits - theirs_logits).abs().max() / theirs_logits.abs().max()).item()
    assert err < 1e-4, f"the copied draft's logits differ from speculators' by {err:.2e} (relative)"
    print(f"speculators → eaglepipe draft: logits agree to {err:.1e} (relative)", flush=True)


# ---------------------------------------------------------------- judge and rows

RECIPES = {"eaglepipe": eaglepipe_recipe, "speculators": speculators_recipe}


def judge_shard(target: Path, drafters: list[Path], layers: list[int], prompts: list[dict], k: int,
                max_new: int, threads: int) -> tuple[list, list[int]]:
    """Every drafter on ``prompts`` with one target (greedy decoding once per prompt, each drafter's output
    checked equal to it) → (SpecStats per drafter, prompts equal per drafter)."""
    from eaglepipe.model.draft import load_draft
    from eaglepipe.serving.evaluate import decode_prompt, load_reference
    from eaglepipe.serving.specdec import SpecStats

    torch.set_num_threads(threads)
    model, eos_ids = load_reference(target)
    drafts = [load_draft(d, model.device.type) for d in drafters]
    stats, equal = [SpecStats(k) for _ in drafters], [0] * len(drafters)
    for prompt in prompts:
        runs, ref, _ = decode_prompt(model, eos_ids, drafts, layers, prompt["input_ids"], k, max_new)
        for i, (out, st) in enumerate(runs):
            stats[i] += st
            equal[i] += out == ref
    return stats, equal


def judge(a, drafters: list[Path], layers: list[int]) -> dict[str, list[dict]]:
    """benchmark → per drafter {tau, acceptance_per_pos, prompts, prompts_equal}: the reference decoder, its
    prompts split over ``--judge-workers`` processes (one fp32 target each; greedy decoding is deterministic, so
    the split changes no figure)."""
    import multiprocessing as mp

    from transformers import AutoTokenizer

    from eaglepipe.serving.specdec import SpecStats

    tok = AutoTokenizer.from_pretrained(a.target)
    sets = {"mtbench": (mtbench_first_turns(), a.mtbench), "humaneval": (humaneval_prompts(a.humaneval), a.humaneval)}
    n, threads = a.judge_workers, max(1, torch.get_num_threads() // a.judge_workers)
    out = {}
    for name, (recs, count) in sets.items():
        if count <= 0:
            continue
        prompts = eval_prompts(tok, recs, count)
        jobs = [(a.target, drafters, layers, prompts[w::n], a.k, a.max_new, threads) for w in range(n)]
        t0 = time.perf_counter()
        if n == 1:
            parts = [judge_shard(*jobs[0])]
        else:
            with mp.get_context("spawn").Pool(n) as pool:
                parts = pool.starmap(judge_shard, jobs)
        print(f"judged {name}: {len(prompts)} prompts × {len(drafters)} drafts in {time.perf_counter() - t0:.0f} s",
              flush=True)
        out[name] = []
        for i in range(len(drafters)):
            st = SpecStats(a.k)
            for stats, _ in parts:
                st += stats[i]
            out[name].append({"tau": st.tau, "acceptance_per_pos": st.acceptance_per_pos, "prompts": len(prompts),
                              "prompts_equal": sum(eq[i] for _, eq in parts)})
    return out


KEY = ("recipe", "benchmark", "machine", "data")  # a row replaces only the earlier row of the same key


def training_data(fs: FeatureSet) -> str:
    """What the drafts were trained on, from the store's manifest: the dataset's own answers, or the target's."""
    r = fs.manifest["regenerate"]
    if not r["regenerate"]:
        return "ShareGPT answers"
    how = "greedy" if r["temperature"] == 0 else f"temperature {r['temperature']}"
    return f"target's answers (regenerated, {how}, {r['max_new_tokens']} new tokens)"


def trained(work: Path) -> list[tuple[Path, dict]]:
    """The drafts a ``--phase train`` left in ``work``: (folder, its peers_info.json), in name order."""
    return [(f.parent, json.loads(f.read_text())) for f in sorted(work.glob("draft-*/peers_info.json"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=REPO / "data/target")
    ap.add_argument("--features", type=Path, default=REPO / "data/features")
    ap.add_argument("--params", type=Path, default=REPO / "params.yaml")
    ap.add_argument("--profile", type=Path, help="merged over params.yaml first (profiles/gpu.yaml on a GPU)")
    ap.add_argument("--set", nargs="*", default=[], help="train.key=value over params.yaml (eaglepipe recipe)")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--spec-set", nargs="*", default=[], help="key=value over speculators' TrainConfig defaults")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--mtbench", type=int, default=16, help="MT-bench first turns judged (80 = all)")
    ap.add_argument("--humaneval", type=int, default=16, help="HumanEval prompts judged (164 = all)")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--peer-path", help="where the speculators wheel (and hs_connectors) were installed")
    ap.add_argument("--work", type=Path, default=REPO / "data/.scratch/peers_quality")  # ignored by git
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--phase", choices=["all", "train", "judge"], default="all",
                    help="train: only train (each draft kept in --work); judge: only judge the drafts kept there")
    ap.add_argument("--judge-workers", type=int, default=1, help="processes judging side by side (GPU: ~12)")
    a = ap.parse_args()
    if a.peer_path:
        sys.path.insert(0, a.peer_path)
    sys.path.insert(0, str(REPO / "benchmarks"))
    p = train_params(a.params, a.profile, a.set, a.epochs)
    fs = FeatureSet(a.features)
    fs.require_store("features", "benchmarks/peers_quality.py (the peers read stored hidden states)")
    done = []
    if a.phase != "judge":
        for recipe in a.recipes:
            name = recipe + "".join(f" {s}" for s in (a.set if recipe == "eaglepipe" else a.spec_set))
            out = a.work / ("draft-" + "_".join(name.replace("=", "-").split()))
            info = RECIPES[recipe](a, p, a.work, out)
            (out / "peers_info.json").write_text(json.dumps({"recipe": name, **info}, indent=1) + "\n")
            done.append(out)
    if a.phase == "train":
        return
    drafts = [d for d in trained(a.work) if a.phase == "judge" or d[0] in done]
    rows = json.loads(a.out.read_text()) if a.out.exists() else []
    results = judge(a, [d for d, _ in drafts], fs.layers)
    data = training_data(fs)
    for bench, per_draft in results.items():
        for (_, info), r in zip(drafts, per_draft):
            row = {"recipe": info["recipe"], "machine": machine(), "data": data, "conversations": len(fs),
                   "epochs": a.epochs, "train_tokens": info["train_tokens"], "train_s": info["train_s"], "judge": f"reference k={a.k}",
                   "benchmark": bench, "prompts": r["prompts"],
                   "max_new_tokens": a.max_new, "tau": round(r["tau"], 4),
                   "acceptance_per_position": [round(x, 4) for x in r["acceptance_per_pos"]],
                   "outputs_equal": r["prompts_equal"] == r["prompts"], "kept_epoch": info["kept_epoch"],
                   "settings": info["settings"], **({"tau_sim_by_epoch": info["tau_sim"]} if "tau_sim" in info else {})}
            rows = [x for x in rows if [x[k] for k in KEY] != [row[k] for k in KEY]]
            rows.append(row)
            print("RESULT peers_quality " + json.dumps(row), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
