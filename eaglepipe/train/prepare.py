"""The set-up of a training run, before the first step: the samples, the draft vocabulary, the draft.

Each function is one numbered step of eaglepipe/train/loop.py's set-up:
 1. :func:`index_features`: the manifest index (nothing read yet); features of another target, fewer than 2
    samples, or a sample longer than ``train.batch_tokens`` are refused; the train / held-out split
    (:func:`eaglepipe.train.packing.split_samples`);
 2. :func:`draft_config` and :func:`draft_vocab`: the draft's shape from the target's config, its vocabulary from
    the train split's predicted tokens (eaglepipe/model/vocab.py; only token ids are read);
 3. :func:`init_draft`: the draft, seeded, its lm_head the target's lm_head rows of the draft vocabulary;
 4. :func:`online_capture` (a tokens store) and :func:`top1_in_vocab`: 1 byte a token, whether the target's
    top-1 is in the draft vocabulary, computed in one streamed pass and kept for the whole run.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from eaglepipe.data.features import FeatureSample, FeatureSet, SampleRef
from eaglepipe.errors import EaglepipeError
from eaglepipe.model.draft import DraftConfig, Eagle3Draft
from eaglepipe.model.target_head import soft_targets
from eaglepipe.model.vocab import DraftVocab, build_draft_vocab, count_predicted_tokens, vocab_stats
from eaglepipe.params import TrainParams
from eaglepipe.train.online import OnlineCapture
from eaglepipe.train.packing import check_lengths, pack, split_samples
from eaglepipe.train.stream import BatchStream

log = logging.getLogger(__name__)


def index_features(features_dir: Path, p: TrainParams, hidden_size: int) -> tuple[FeatureSet, list, list]:
    """(store, train refs, held-out refs) from the manifest, checked without reading a feature.

    Raises EaglepipeError (aux width ≠ the target's ``hidden_size``: features of another target; < 2 samples),
    TrainingError (a sample longer than train.batch_tokens, :func:`eaglepipe.train.packing.check_lengths`).
    """
    fs = FeatureSet(features_dir)
    width = fs.aux_shape()[-1] if fs.store == "features" and fs.refs else fs.manifest["target"]["hidden_size"]
    if fs.refs and width != hidden_size:
        raise EaglepipeError(
            f"features {features_dir}: aux width {width} != target hidden_size {hidden_size}; "
            "the features were captured from another target")
    if len(fs) < 2:
        raise EaglepipeError(f"features {features_dir}: {len(fs)} samples; need ≥ 2 (train + held-out)")
    check_lengths(fs.refs, p.batch_tokens)
    train, held = split_samples(fs.refs, p.eval_fraction, p.seed)
    return fs, train, held


def draft_config(target_config: dict, n_aux: int, p: TrainParams) -> DraftConfig:
    """The draft's shape: the target's hidden size, heads and vocabulary, ``n_aux`` captured layers fed to fc."""
    cfg = DraftConfig.from_target(target_config, n_aux=n_aux, draft_vocab_size=p.draft_vocab_size,
                                  intermediate_size=p.draft_intermediate_size, norms=p.draft_norms)
    if cfg.n_aux != 3:  # both engines size fc from num_aux_hidden_states, which export writes (convention.py)
        log.info("%d aux layers: fc reads %d·Ht; export writes num_aux_hidden_states = %d, from which SGLang's and "
                 "vLLM's llama_eagle3.py size fc", cfg.n_aux, cfg.n_aux, cfg.n_aux)
    return cfg


def draft_vocab(fs: FeatureSet, train: list[SampleRef], held: list[SampleRef], vocab_size: int,
                draft_vocab_size: int) -> tuple[DraftVocab, dict]:
    """(the draft vocabulary, its coverage stats) from the predicted tokens of ``train`` (token ids only read);
    ``held`` only for the log line."""
    counts = count_predicted_tokens((FeatureSample(r.id, *fs.tokens(r), None, None) for r in train), vocab_size)
    vocab = build_draft_vocab(counts, draft_vocab_size)
    stats = vocab_stats(counts, vocab)
    log.info("samples: %d train / %d eval; draft vocab %d covers %.1f%% of predicted tokens",
             len(train), len(held), vocab.size, 100 * stats["coverage"])
    return vocab, stats


def init_draft(cfg: DraftConfig, vocab: DraftVocab, target_lm_head: torch.Tensor, seed: int,
               device: torch.device) -> Eagle3Draft:
    """The draft on ``device``: initialised after ``torch.manual_seed(seed)`` (the global RNG: nothing else draws
    from it before), d2t / t2d set, lm_head (Vd, H) copied from the target's lm_head rows ``target_lm_head[t2d]``
    (as speculators starts); the norm weight starts at 1."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    with torch.no_grad():
        draft.lm_head.weight.copy_(target_lm_head[vocab.t2d])  # (Vd, H)
    return draft.to(device)


def online_capture(target_dir: Path, fs: FeatureSet, device: torch.device, p: TrainParams) -> OnlineCapture | None:
    """The frozen target computing features in the loop for a tokens store (token budget 2 × batch_tokens, its
    layers compiled with train.fast and train.compile_capture on CUDA); None for a features store."""
    if fs.store != "tokens":
        return None
    return OnlineCapture(target_dir, fs.manifest, device, 2 * p.batch_tokens,
                         compile=p.fast and p.compile_capture and device.type == "cuda")


@torch.no_grad()
def top1_in_vocab(head, features_dir: Path, refs: list[SampleRef], t2d: torch.Tensor, max_tokens: int,
                  capture: OnlineCapture | None = None) -> dict[str, torch.Tensor]:
    """sample id → (T,) bool: the target's full-vocabulary top-1 is in the draft vocabulary (one streamed pass
    over rows of ≤ ``max_tokens`` tokens, reused every epoch; 1 byte a token; online, one target forward a row,
    not one a sample). ``head``: the full TargetHead on the device. Raises like :class:`BatchStream`."""
    dev = head.lm_head.device
    out = {}
    rows = pack([r.n_tokens for r in refs], list(range(len(refs))), max_tokens)
    for row, b in BatchStream(features_dir, [[refs[i] for i in r] for r in rows], capture=capture):
        top = soft_targets(head, b.last.to(dev), t2d, need=b.loss_mask.to(dev)).top_in_vocab[0].cpu()  # (T,)
        for ref, t in zip(row, top.split(torch.bincount(b.doc[0].cpu(), minlength=len(row)).tolist())):
            out[ref.id] = t
    return out
