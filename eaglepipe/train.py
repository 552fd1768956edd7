"""The training loop of the draft: data split and packing, AdamW + warmup/cosine, TTT loss, DDP, checkpoints
with resume, per-epoch evaluation by τ_sim, dvclive curves, and the best draft written out.

Numbered steps (as in :func:`train_drafter`):
 1. read the features (token hashes re-checked by FeatureSet), the target's config / head / embeddings;
 2. split samples into train / eval by a hash of (seed, sample id) — stable when samples are added;
 3. draft vocabulary from the train split's predicted tokens (vocab.py);
 4. build the draft (seeded), lm_head initialised from the target's lm_head rows of the draft vocabulary;
 5. resume from ``<scratch>/<run key>/last.pt`` when a killed run with the same key left one;
 6. per epoch: shuffle (seed, epoch), pack into rows of ≤ batch_tokens, rank r takes micro-batches r::world,
    an optimizer step every grad_accum micro-batches; checkpoint every checkpoint_every steps;
 7. after each epoch: evaluate the held-out samples, keep the weights with the best τ_sim (not the best loss);
 8. write the best draft (draft.save_draft) and return the summary for the metrics json.

Precision: on CUDA the forward runs under bf16 autocast with fp32 master weights (the engines serve in bf16);
on CPU it runs in fp32 — CPU bf16 autocast is slower than fp32 on most CPUs without AMX and would make the
resume/DDP equality tests depend on kernel choice.

DDP: under torchrun (WORLD_SIZE > 1) each rank reads all samples and takes every world-th micro-batch; one
step of W ranks × accum a equals one process with accum W·a on the same micro-batches. Checkpoints are written
by rank 0; every rank resumes from it (nothing random is drawn during training, so rank 0's RNG state suffices).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .draft import DraftConfig, Eagle3Draft, n_params, save_draft
from .errors import EaglepipeError
from .features import FeatureSample, FeatureSet, run_key
from .params import TrainParams
from .target_head import load_target_config, load_target_head, soft_targets
from .ttt import Batch, TTTUnroll, tau_sim
from .vocab import build_draft_vocab, count_predicted_tokens, vocab_stats

log = logging.getLogger(__name__)

CKPT = "last.pt"


# ---------------------------------------------------------------- data


def split_samples(samples: list[FeatureSample], eval_fraction: float, seed: int):
    """(train, eval): the ceil(eval_fraction·n) samples with the smallest sha256(seed:id) are held out."""
    n_eval = min(len(samples) - 1, max(1, math.ceil(eval_fraction * len(samples))))
    key = {s.id: hashlib.sha256(f"{seed}:{s.id}".encode()).hexdigest() for s in samples}
    held = set(sorted(key, key=key.get)[:n_eval])
    return [s for s in samples if s.id not in held], [s for s in samples if s.id in held]


def pack(lengths: list[int], order: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy packing in ``order``: consecutive samples share a row while the row stays ≤ max_tokens."""
    rows, cur, n = [], [], 0
    for i in order:
        L = min(lengths[i], max_tokens)
        if cur and n + L > max_tokens:
            rows.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += L
    if cur:
        rows.append(cur)
    return rows


def collate(samples: list[FeatureSample], max_tokens: int, inv: dict[str, torch.Tensor] | None = None) -> Batch:
    """Samples → one packed row (B = 1); each sample is cut to max_tokens. ``inv``: sample id → top-1-in-vocab."""
    parts = [(s, min(len(s.input_ids), max_tokens)) for s in samples]
    cat = lambda f: torch.cat([getattr(s, f)[:n] for s, n in parts])[None]  # noqa: E731  (1, T, ...)
    return Batch(
        top_in_vocab=None if inv is None else torch.cat([inv[s.id][:n] for s, n in parts])[None],  # (1, T)
        input_ids=cat("input_ids").long(),  # (1, T)
        positions=torch.cat([torch.arange(n) for _, n in parts])[None],  # (1, T)
        doc=torch.cat([torch.full((n,), d) for d, (_, n) in enumerate(parts)])[None],  # (1, T)
        loss_mask=cat("loss_mask").bool(),  # (1, T)
        aux=cat("aux"),  # (1, T, L, Ht)
        last=cat("last"),  # (1, T, H)
    )


def top1_in_vocab(head, samples: list[FeatureSample], t2d: torch.Tensor) -> dict[str, torch.Tensor]:
    """sample id → (T,) bool: the target's full-vocabulary top-1 is in the draft vocabulary (one pass, reused)."""
    dev = head.lm_head.device
    return {s.id: soft_targets(head, s.last[None].to(dev), t2d).top_in_vocab[0].cpu() for s in samples}


def epoch_rows(lengths: list[int], seed: int, epoch: int, max_tokens: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return pack(lengths, torch.randperm(len(lengths), generator=g).tolist(), max_tokens)


# ---------------------------------------------------------------- schedule, distributed, checkpoints


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Dist:
    """Join the torchrun process group when WORLD_SIZE > 1 (nccl on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def pick_device(d: Dist) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(d.local_rank)
        return torch.device("cuda", d.local_rank)
    return torch.device("cpu")


def rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def atomic_save(obj, path: Path) -> None:
    tmp = Path(str(path) + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# ---------------------------------------------------------------- the loop


@dataclass
class State:
    """Everything a resumed run needs besides model / optimizer / scheduler."""

    epoch: int = 0  # current epoch
    micro: int = 0  # next micro-batch (this rank's list) within the epoch
    step: int = 0  # optimizer steps done
    tokens: int = 0  # token positions processed, all ranks
    seconds: float = 0.0  # training wall time so far
    best_tau: float = -1.0
    best_epoch: int = -1
    best_acc: list = field(default_factory=list)
    best_state: dict | None = None  # draft weights (cpu) of the best epoch
    evals: list = field(default_factory=list)  # one dict per epoch
    losses: list = field(default_factory=list)  # train loss per optimizer step (for tests and the json)


@torch.no_grad()
def evaluate(unroll: TTTUnroll, head, samples, inv, max_tokens: int, device, autocast) -> dict:
    """TTT on held-out samples: per-step accuracy over counted positions, mean loss, τ_sim, OOV top-1 share."""
    lengths = [len(s.input_ids) for s in samples]
    S = unroll.steps
    correct, counted, trained = torch.zeros(S), torch.zeros(S), torch.zeros(S)
    loss, n = 0.0, 0
    for row in pack(lengths, list(range(len(samples))), max_tokens):
        b = collate([samples[i] for i in row], max_tokens, inv).to(device)
        soft = soft_targets(head, b.last, unroll.draft.t2d, b.top_in_vocab)
        with autocast():
            r = unroll(b, soft)
        correct += r.correct.cpu()
        counted += r.counted.cpu()
        trained += r.trained.cpu()
        loss, n = loss + float(r.loss), n + 1
    acc = (correct / counted.clamp(min=1)).tolist()
    return {
        "loss": loss / max(n, 1),
        "acc": acc,
        "tau_sim": tau_sim(acc),
        "oov_top1": float(1 - trained[0] / counted[0].clamp(min=1)),
        "positions": int(counted[0]),
    }


def train_drafter(
    features_dir: str | Path,
    target_dir: str | Path,
    out_dir: str | Path,
    p: TrainParams,
    *,
    scratch_dir: str | Path,
    live_dir: str | Path | None = None,
    stop_after: int | None = None,
) -> dict:
    """Train, keep the best epoch by τ_sim, write ``out_dir`` (draft.save_draft), return the summary dict.

    scratch_dir: where ``<run key>/last.pt`` lives (outside DVC outs, so a killed run resumes).
    live_dir: dvclive folder (None: no dvclive).
    stop_after: stop (as if killed) right after the checkpoint of this optimizer step (tests).
    """
    d = init_distributed()
    device = pick_device(d)
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        if device.type == "cuda"
        else (lambda: torch.autocast("cpu", enabled=False))
    )

    # 1. features and target
    fs = FeatureSet(features_dir)
    samples = list(fs)
    target_cfg = load_target_config(target_dir)
    head = load_target_head(target_dir)
    cfg = DraftConfig.from_target(target_cfg, n_aux=len(fs.layers), draft_vocab_size=p.draft_vocab_size)
    if samples and samples[0].aux.shape[-1] != cfg.target_hidden_size:
        raise EaglepipeError(
            f"features {features_dir}: aux width {samples[0].aux.shape[-1]} != target hidden_size "
            f"{cfg.target_hidden_size} of {target_dir}; the features were captured from another target"
        )
    if cfg.n_aux != 3:  # both engines size fc from num_aux_hidden_states, which export writes (convention.py)
        log.info("%d aux layers: fc reads %d·Ht; export writes num_aux_hidden_states = %d, from which SGLang's and "
                 "vLLM's llama_eagle3.py size fc", cfg.n_aux, cfg.n_aux, cfg.n_aux)
    if len(samples) < 2:
        raise EaglepipeError(f"features {features_dir}: {len(samples)} samples; need ≥ 2 (train + held-out)")

    # 2-3. split and vocabulary
    train, held = split_samples(samples, p.eval_fraction, p.seed)
    counts = count_predicted_tokens(train, cfg.vocab_size)
    vocab = build_draft_vocab(counts, p.draft_vocab_size)
    vstats = vocab_stats(counts, vocab)
    log.info("samples: %d train / %d eval; draft vocab %d covers %.1f%% of predicted tokens",
             len(train), len(held), vocab.size, 100 * vstats["coverage"])

    # 4. model
    torch.manual_seed(p.seed)
    draft = Eagle3Draft(cfg)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    with torch.no_grad():  # start from the target's lm_head rows (as speculators does). Also copying the target's
        # final norm weight was tried on SmolLM2 features: less stable (eval loss rose at lr 3e-3), so norm starts at 1
        draft.lm_head.weight.copy_(head.lm_head[vocab.t2d])  # (Vd, H)
    draft.to(device)
    head = head.to(device)
    inv = top1_in_vocab(head, samples, draft.t2d)  # sample id → (T,) bool, on the CPU like the samples
    unroll = TTTUnroll(draft, head.embed, p.ttt_steps, p.step_decay).to(device)
    ids = [device.index] if device.type == "cuda" else None
    model = DDP(unroll, device_ids=ids, broadcast_buffers=False) if d.world > 1 else unroll
    opt = torch.optim.AdamW(draft.parameters(), lr=p.lr, weight_decay=p.weight_decay, betas=(0.9, 0.95))

    lengths = [len(s.input_ids) for s in train]
    # packing depends on the shuffle, so the number of rows (and steps) may differ by one between epochs
    steps_per_epoch = lambda rows: (len(rows) // d.world) // p.grad_accum  # noqa: E731
    per_epoch = [steps_per_epoch(epoch_rows(lengths, p.seed, e, p.batch_tokens)) for e in range(p.epochs)]
    total_steps = sum(per_epoch)
    if min(per_epoch) == 0:
        raise EaglepipeError(
            f"{len(train)} training samples packed in rows of ≤{p.batch_tokens} tokens cannot make one step of "
            f"{d.world} ranks × grad_accum {p.grad_accum} per epoch; lower train.batch_tokens or train.grad_accum"
        )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, p.warmup_steps, total_steps))

    # 5. resume
    key = run_key({"train": p.model_dump(), "features": fs.manifest.get("run_key"), "n": len(samples),
                   "target": target_cfg, "world": d.world})
    ckpt_dir = Path(scratch_dir) / key
    st, resumed_from = State(), 0
    if (ckpt_dir / CKPT).exists():
        ck = torch.load(ckpt_dir / CKPT, map_location="cpu", weights_only=False)
        draft.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        set_rng_state(ck["rng"])
        st = ck["state"]
        resumed_from = st.step
        log.info("resumed %s at epoch %d, micro-batch %d, step %d", ckpt_dir / CKPT, st.epoch, st.micro, st.step)
    if d.main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)

    def checkpoint() -> None:
        if d.main:
            atomic_save({"model": draft.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                         "rng": rng_state(), "state": st}, ckpt_dir / CKPT)
        if d.world > 1:
            dist.barrier()

    live = None
    if live_dir is not None and d.main:
        try:
            from dvclive import Live
        except ImportError:  # e.g. the GPU image: curves are lost, metrics JSON still written
            log.warning("dvclive is not installed: no training curves in %s", live_dir)
        else:
            live = Live(str(live_dir), resume=st.step > 0, save_dvc_exp=False, dvcyaml=None, report=None)
    log.info("draft: %d trainable parameters, %d optimizer steps, device %s, world %d",
             n_params(draft), total_steps, device, d.world)

    # 6-7. epochs
    while st.epoch < p.epochs:
        rows = epoch_rows(lengths, p.seed, st.epoch, p.batch_tokens)
        n_micro = steps_per_epoch(rows) * p.grad_accum
        mine = rows[d.rank :: d.world][:n_micro]
        t0 = time.time()
        acc_stats = torch.zeros(3 * p.ttt_steps + 2, device=device)  # loss_j, correct_j, counted_j, loss, tokens
        while st.micro < n_micro:
            b = collate([train[i] for i in mine[st.micro]], p.batch_tokens, inv).to(device)
            soft = soft_targets(head, b.last, draft.t2d, b.top_in_vocab)
            last_micro = (st.micro + 1) % p.grad_accum == 0
            sync = model.no_sync() if (d.world > 1 and not last_micro) else nullcontext()
            with sync:
                with autocast():
                    r = model(b, soft)
                (r.loss / p.grad_accum).backward()
            S = p.ttt_steps
            acc_stats[:S] += r.step_loss / p.grad_accum
            acc_stats[S : 2 * S] += r.correct
            acc_stats[2 * S : 3 * S] += r.counted
            acc_stats[3 * S] += r.loss.detach() / p.grad_accum
            acc_stats[3 * S + 1] += b.input_ids.numel()
            st.micro += 1
            if not last_micro:
                continue
            torch.nn.utils.clip_grad_norm_(draft.parameters(), p.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if d.world > 1:
                dist.all_reduce(acc_stats)
                acc_stats[:S] /= d.world
                acc_stats[3 * S] /= d.world
            st.step += 1
            st.tokens += int(acc_stats[3 * S + 1])
            st.losses.append(float(acc_stats[3 * S]))
            if live is not None:
                live.step = st.step
                live.log_metric("train/loss", float(acc_stats[3 * S]))
                live.log_metric("train/lr", sched.get_last_lr()[0])
                for j in range(S):
                    live.log_metric(f"train/loss_step{j}", float(acc_stats[j]))
                    live.log_metric(f"train/acc_step{j}", float(acc_stats[S + j] / acc_stats[2 * S + j].clamp(min=1)))
                live.next_step()
            acc_stats.zero_()
            if st.step % p.checkpoint_every == 0 or st.step == stop_after:
                st.seconds += time.time() - t0
                t0 = time.time()
                checkpoint()
            if st.step == stop_after:
                log.info("stopping after step %d (stop_after)", st.step)
                return {"stopped_at": st.step, "losses": st.losses}
        st.seconds += time.time() - t0

        ev = evaluate(unroll, head, held, inv, p.batch_tokens, device, autocast)
        ev["epoch"], ev["step"] = st.epoch, st.step
        st.evals.append(ev)
        log.info("epoch %d: eval loss %.4f, acc %s, tau_sim %.3f", st.epoch, ev["loss"],
                 [round(a, 3) for a in ev["acc"]], ev["tau_sim"])
        if live is not None:
            live.step = st.step
            live.log_metric("eval/tau_sim", ev["tau_sim"])
            live.log_metric("eval/loss", ev["loss"])
            for j, a in enumerate(ev["acc"]):
                live.log_metric(f"eval/acc_step{j}", a)
            live.next_step()
        if ev["tau_sim"] > st.best_tau:
            st.best_tau, st.best_epoch, st.best_acc = ev["tau_sim"], st.epoch, ev["acc"]
            st.best_state = {k: v.detach().cpu().clone() for k, v in draft.state_dict().items()}
        st.epoch, st.micro = st.epoch + 1, 0
        checkpoint()

    # 8. outputs
    per_step = lambda acc: {f"step{j}": round(a, 4) for j, a in enumerate(acc)}  # noqa: E731  flat for dvc
    summary = {
        "draft": cfg.to_dict(),
        "layers": fs.layers,
        "vocab": vstats,
        "samples": {"train": len(train), "eval": len(held)},
        "train_tokens": st.tokens,
        "steps": st.step,
        "seconds": round(st.seconds, 2),
        "tokens_per_s": round(st.tokens / st.seconds, 1) if st.seconds else 0.0,
        "best": {"epoch": st.best_epoch, "tau_sim": round(st.best_tau, 4), "acc": per_step(st.best_acc)},
        "oov_top1": round(st.evals[-1]["oov_top1"], 4),
        "evals": {f"epoch{e['epoch']}": {"tau_sim": round(e["tau_sim"], 4), "loss": round(e["loss"], 4),
                                         "acc": per_step(e["acc"])} for e in st.evals},
        "final_train_loss": st.losses[-1] if st.losses else None,
        "device": str(device),
        "world_size": d.world,
        "resumed_from_step": resumed_from,
    }
    if d.main:
        draft.load_state_dict(st.best_state)
        save_draft(draft, Path(out_dir), extra={"layers": fs.layers, "target": str(target_dir),
                                                "best_tau_sim": st.best_tau, "best_epoch": st.best_epoch})
        if live is not None:
            live.log_metric("best/tau_sim", st.best_tau, plot=False)
            live.end()
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    if d.world > 1:
        dist.barrier()
    summary["losses"] = st.losses
    return summary

