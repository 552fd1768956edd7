"""The extract stage's logic: regenerate → template + loss mask → capture h[k] (k in layers) and h[N] → shards.

Steps, per shard of ``shard_size`` conversations (the unit of resume):
  1. regenerate (optional): every assistant turn i is replaced by the target's own completion of
     ``msgs[:i]`` (earlier turns already regenerated), batched over conversations at the same turn, by
     ``extract.regenerate_engine`` (default: the capture engine; e.g. vLLM for a GPU run's speed);
  2. tokenize with the target's chat template; loss mask over predictions (:mod:`eaglepipe.data.template`);
  3. capture the boundaries ``layers + [N]`` through the engine, with the ids translated into that engine's
     meaning by :func:`eaglepipe.contract.convention.engine_ids`;
  4. quarantine every sample whose features hold NaN/inf (left out, recorded with the shard), then write the
     shard atomically and byte-reproducibly (:class:`eaglepipe.data.features.ShardWriter`).
With ``extract.store: tokens`` (online training) step 3 runs only for the shards holding the first
``gate_samples`` conversations (the whole shard is captured, so their features are bit-equal to a features
store's), only those keep features, and each shard also stores the (regenerated) conversations; see
eaglepipe/data/features.py.
The engine starts only if some shard is missing, so a finished run restarted does no work. Shards spread over
processes by ``extract.workers`` (here) or over torchrun ranks on GPUs and hosts (data/distributed_extract.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from eaglepipe.contract import convention
from eaglepipe.data.distributed_extract import ALONE, Replica, agree, gather_to_rank0
from eaglepipe.data.features import (
    FeatureSample,
    ShardWriter,
    non_finite,
    run_key,
    store_capture,
)
from eaglepipe.data.prompts import is_synthetic
from eaglepipe.data.regenerate import drop_empty_synthetic, regenerate
from eaglepipe.data.template import tokenize_conversation, tokenize_generated
from eaglepipe.engines import engine_version, get_engine
from eaglepipe.params import ExtractParams
from eaglepipe.sources import code_hash
from eaglepipe.target.info import TargetInfo
from eaglepipe.target.reasoning import template_kwargs

log = logging.getLogger(__name__)

# The stage script whose import closure decides the shards' content (part of the resume key).
EXTRACT_SCRIPT = Path(__file__).resolve().parents[2] / "stages" / "extract.py"

@dataclass
class ExtractStats:
    samples: int
    tokens: int
    loss_tokens: int
    seconds: float
    capture_seconds: float
    generate_seconds: float
    tokens_per_s: float  # captured tokens per second of capture (the engine forward + hooks)
    bytes_per_token: float
    resumed_shards: int
    quarantined: int  # samples left out because their features held NaN/inf (listed in the manifest)
    synthetic: int = 0  # prompts.synthetic conversations asked for ...
    synthetic_written: int = 0  # ... and written (the rest: an empty user turn, or quarantined)
    thinking: dict | None = None  # extract.thinking set: samples with it on / off, reasoning / answer tokens, cut traces


def quarantine(samples: list[FeatureSample]) -> tuple[list[FeatureSample], list[dict]]:
    """(samples whose aux and last are all finite, rows ``{"id", "tensor", "non_finite"}`` of the others).

    Checked after the cast to the store dtype: a value finite in float32 but past the range of float16
    would overflow there and is quarantined too.
    """
    kept, bad = [], []
    for s in samples:
        q = non_finite(s)
        if q is None:
            kept.append(s)
        else:
            log.warning("sample %r: %d non-finite values in %s; quarantined (left out of the features)",
                        s.id, q["non_finite"], q["tensor"])
            bad.append(q)
    return kept, bad


# ExtractParams fields that change how the shards are made, not what they hold: plan_key ignores them; the
# manifest header ignores the layout over processes (batch_size has always been recorded there, and stays, so its
# bytes do not move).
_LAYOUT = {"workers", "nproc_per_node"}
_NOT_IN_SHARDS = {"batch_size", *_LAYOUT}


def plan_key(info: TargetInfo, layers: list[int], p: ExtractParams, engine: str, prompts_hash: str,
             gate_samples: int = 0, tensor_parallel_size: int = 1, expert_parallel: bool = False) -> str:
    """Hash of everything that determines the shards (keys the resumable scratch folder), the code included."""
    spec = {
        "code": code_hash(EXTRACT_SCRIPT),
        "target": info.content_hash, "layers": layers, "engine": engine, "prompts": prompts_hash,
        "extract": p.model_dump(exclude=_NOT_IN_SHARDS),
    }
    if tensor_parallel_size > 1:  # a sharded target's reductions round differently
        spec["tensor_parallel_size"] = tensor_parallel_size
    if expert_parallel:  # whole experts per rank: another reduction order again
        spec["expert_parallel"] = True
    if p.store == "tokens":
        spec["gate_samples"] = gate_samples
    return run_key(spec)


def extract(
    convs: list[dict], target_dir: Path, info: TargetInfo, layers: list[int], p: ExtractParams,
    out_dir: Path, scratch: Path, prompts_hash: str, gate_samples: int = 0, tensor_parallel_size: int = 1,
    replica: Replica = ALONE, expert_parallel: bool = False,
) -> tuple[dict, ExtractStats] | None:
    """Run steps 1–4 over ``convs`` and write ``out_dir`` (shards + manifest.json).

    gate_samples: with ``p.store == "tokens"``, how many leading conversations keep their features (what
    validate_offsets reads: ``validate.samples``); ignored for a features store.
    tensor_parallel_size: the engine's (params ``tensor_parallel_size``; recorded when > 1): vllm / sglang start
    their own tensor-parallel workers; hf at T > 1 is this torchrun world of T ranks (``replica.tp`` = T), each
    loading its shard of the target (transformers ``tp_plan="auto"``) and running every batch with the others.
    expert_parallel: the vllm / sglang engine splits an MoE target's experts over those ranks (params
    ``expert_parallel``; recorded when true).
    replica: this process's rank under torchrun (:mod:`eaglepipe.data.distributed_extract`): its replica extracts
    shard i for i mod replicas == its index (the replica's first rank writes it), and rank 0, once every rank is
    done, writes ``out_dir`` and returns; the other ranks return None. The same bytes as one process for any layout
    of replicas (not across tensor_parallel_size: a sharded target's reductions round differently).
    The engine starts at the first missing shard and is closed when this returns or raises.
    Raises ConventionError (untranslatable layers for that engine), CaptureMismatch (template problems).
    """
    gate_samples = gate_samples if p.store == "tokens" else 0
    key = plan_key(info, layers, p, p.engine, prompts_hash, gate_samples, tensor_parallel_size, expert_parallel)
    agree(replica, "run key", key)  # before the writer, which clears scratch folders of other keys
    writer = ShardWriter(out_dir, scratch, key, p.shard_size)
    chunks = [convs[i : i + p.shard_size] for i in range(0, len(convs), p.shard_size)]
    mine = replica.shards(len(chunks))  # every shard when alone
    todo = [i for i in mine if not writer.done(i)]
    resumed = len(mine) - len(todo)
    if resumed:
        log.info("resuming: %d of %d shards already written (key %s)%s", resumed, len(mine), key, replica.label)
    ids = convention.engine_ids(p.engine, info.family, layers + [info.n_layers], info.n_layers)
    timing = _Timing(time.perf_counter())
    work = _ShardWork(target_dir, info, ids, p, writer, gate_samples, tensor_parallel_size=tensor_parallel_size,
                      writes=replica.writes, expert_parallel=expert_parallel)
    total, left = sum(len(chunks[i]) for i in mine), sum(len(chunks[i]) for i in todo)
    with tqdm(total=total, initial=total - left, unit="sample", desc=replica.label.strip(" ()") or None) as bar:
        if p.workers > 1 and len(todo) > 1:
            _in_workers(work, {i: chunks[i] for i in todo}, timing, bar)
        else:
            work.run({i: chunks[i] for i in todo}, timing, bar)
    parts = gather_to_rank0(replica, (timing, resumed) if replica.writes else None)  # rank 0 waits for every rank
    if parts is None:
        return None
    for other, other_resumed in filter(None, parts[1:]):  # one part per replica: its ranks counted its tokens once
        timing.absorb(other)
        resumed += other_resumed
    header = _header(p, info, layers, ids, timing, prompts_hash, gate_samples, tensor_parallel_size, expert_parallel)
    manifest = writer.finish(header, len(chunks))
    n_synthetic = sum(is_synthetic(c["id"]) for c in convs)
    return manifest, _stats(manifest, out_dir, timing, resumed, n_synthetic)


def _header(p: ExtractParams, info: TargetInfo, layers: list[int], ids: list[int], timing: _Timing,
            prompts_hash: str, gate_samples: int, tensor_parallel_size: int, expert_parallel: bool = False) -> dict:
    """The manifest's header: what made the features (never how the work was laid out over processes)."""
    header = {
        "engine": p.engine, "engine_version": timing.version or engine_version(p.engine), "layers": layers,
        "dtype": p.dtype,
        "target": {"hash": info.content_hash, "n_layers": info.n_layers, "hidden_size": info.hidden_size,
                   "vocab_size": info.vocab_size, "model_type": info.model_type, "family": info.family},
        "capture_ids": ids, "regenerate": p.model_dump(exclude=_LAYOUT) if p.regenerate else None,
        "prompts_hash": prompts_hash,
        "store": p.store,
        **({"quantization": p.quantization} if p.quantization else {}),  # the extracting engine's (ExtractParams)
        **({"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}),
        **({"expert_parallel": True} if expert_parallel else {}),
    }
    if p.store == "tokens":  # what train_drafter's online capture needs to compute what this would have stored
        header.update(gate_samples=gate_samples, engine_dtype=p.engine_dtype)
    return header


@dataclass
class _Timing:
    """What one extract run counts as it goes: seconds since ``t0``, captured tokens, the engine's version."""

    t0: float
    capture: float = 0.0
    generate: float = 0.0
    tokens: int = 0
    version: str | None = None

    def absorb(self, other: _Timing) -> None:
        """Count another process's work in: the slowest one's seconds (the wall waited), every one's tokens."""
        self.capture, self.generate = max(self.capture, other.capture), max(self.generate, other.generate)
        self.tokens += other.tokens
        self.version = self.version or other.version


class _Engines:
    """extract's engines, each started at its first use and closed with ``stack``: ``capture()`` is
    ``extract.engine``'s, ``regenerate()`` is ``extract.regenerate_engine``'s (the same one when unset)."""

    def __init__(self, stack: ExitStack, target_dir: Path, info: TargetInfo, p: ExtractParams,
                 memory_share: float = 1.0, tensor_parallel_size: int = 1, expert_parallel: bool = False):
        self.stack, self.target_dir, self.info, self.p = stack, target_dir, info, p
        self.memory_share, self.tensor_parallel_size = memory_share, tensor_parallel_size
        self.expert_parallel = expert_parallel
        self.running: dict[str, object] = {}

    def _get(self, name: str):
        if name not in self.running:
            p = self.p
            self.running[name] = self.stack.enter_context(get_engine(
                name, self.target_dir, dtype=p.engine_dtype, batch_size=p.batch_size, info=self.info,
                quantization=p.quantization, memory_share=self.memory_share,
                tensor_parallel_size=self.tensor_parallel_size, expert_parallel=self.expert_parallel))
        return self.running[name]

    def capture(self):
        return self._get(self.p.engine)

    def regenerate(self):
        return self._get(self.p.regenerate_engine or self.p.engine)


def _shard_samples(engines: _Engines, tok, chunk: list[dict], ids: list[int], p: ExtractParams, timing: _Timing,
                   gate: int):
    """Steps 1–3 for one shard's conversations: (their FeatureSamples in the store dtype, before quarantine;
    id → messages for a tokens store, else None). Only the first ``gate`` samples keep features (all of them in
    a features store); the shard is captured whole when any does, none of it when none does."""
    if p.regenerate:
        t0 = time.perf_counter()
        chunk, dropped = drop_empty_synthetic(regenerate(engines.regenerate(), tok, chunk, p,
                                                         engines.info.thinking_switch))
        timing.generate += time.perf_counter() - t0
        if dropped:
            log.warning("%d synthetic conversations left out: the target wrote an empty user turn", dropped)
    switch = engines.info.thinking_switch
    toks = [tokenize_generated(tok, **conv["generated"], max_length=p.max_length, train_reasoning=p.train_reasoning)
            if "generated" in conv else
            tokenize_conversation(tok, conv["messages"], p.max_length,
                                  template_kwargs(switch, conv.get("thinking"), p.reasoning_effort), p.train_reasoning)
            for conv in chunk]
    caps = [None] * len(chunk)
    if gate and chunk:
        t0 = time.perf_counter()
        engine = engines.capture()
        caps = engine.capture([t.input_ids.tolist() for t in toks], ids)  # per sample (T, L+1, H) float32
        timing.capture += time.perf_counter() - t0
        timing.version = engine.version
        timing.tokens += sum(len(t.input_ids) for t in toks)
    samples = []
    for j, (conv, t, h) in enumerate(zip(chunk, toks, caps)):
        aux, last = store_capture(h, p.dtype) if j < gate else (None, None)
        samples.append(FeatureSample(conv["id"], t.input_ids, t.loss_mask, aux, last, _kind(conv, t)))
    messages = {conv["id"]: conv["messages"] for conv in chunk} if p.store == "tokens" else None
    return samples, messages


def _kind(conv: dict, t) -> dict | None:
    """A thinking-mode sample's counts for the manifest (:class:`eaglepipe.data.features.FeatureSample` ``kind``):
    its mode, its assistant tokens inside and outside the reasoning, whether its trace was cut."""
    if "thinking" not in conv:
        return None
    reasoning = int(t.reasoning.sum())
    return {"thinking": conv["thinking"], "reasoning_tokens": reasoning,
            "answer_tokens": int(t.assistant.sum()) - reasoning, "reasoning_cut": t.open_at_end}


@dataclass
class _ShardWork:
    """What any process needs to extract shards (picklable: a worker process gets a copy)."""

    target_dir: Path
    info: TargetInfo
    ids: list[int]
    p: ExtractParams
    writer: ShardWriter
    gate_samples: int
    memory_share: float = 1.0  # of the GPU memory a vLLM instance asks for (1/n for n workers)
    tensor_parallel_size: int = 1  # GPUs (CPU core groups) each engine instance shards the target over
    writes: bool = True  # False on the ranks of an hf tensor-parallel replica but its first: they compute, it writes
    expert_parallel: bool = False  # an MoE target's experts split over those ranks

    def run(self, chunks: dict[int, list[dict]], timing: _Timing, bar=None, start_lock=None, stop=None) -> _Timing:
        """Extract and write shard i = each key of ``chunks`` with this process's engines; returns ``timing``.

        start_lock: held while this process's first engine instance starts (workers' vLLM instances profile GPU
        memory one at a time: an instance that sees another's memory change during its profiling refuses to
        start, or sizes its KV cache from the wrong figure). stop: an Event; once set, no further shard is begun.
        """
        from transformers import AutoTokenizer

        p = self.p
        tok = AutoTokenizer.from_pretrained(self.target_dir)
        with ExitStack() as stack:
            engines = _Engines(stack, self.target_dir, self.info, p, self.memory_share, self.tensor_parallel_size,
                               self.expert_parallel)
            if start_lock is not None:
                with start_lock:
                    if p.regenerate:
                        engines.regenerate().start_generation()
                    else:
                        engines.capture().start_capture(self.ids)
            for i, chunk in chunks.items():
                if stop is not None and stop.is_set():
                    break
                gate = (min(len(chunk), max(0, self.gate_samples - i * p.shard_size)) if p.store == "tokens"
                        else len(chunk))
                samples, messages = _shard_samples(engines, tok, chunk, self.ids, p, timing, gate)
                kept, bad = quarantine(samples)
                if self.writes:
                    self.writer.write(i, kept, bad,
                                      messages=None if messages is None else [messages[s.id] for s in kept])
                if bar is not None:
                    bar.update(len(chunk))
                    bar.set_postfix(tok_s=f"{timing.tokens / max(timing.capture, 1e-9):.0f}")
        return timing


def _worker(work: _ShardWork, chunks: dict[int, list[dict]], threads: int, start_lock, stop) -> _Timing:
    logging.basicConfig(level=logging.INFO, format=f"[extract worker {min(chunks)}] %(levelname)s %(name)s: "
                        "%(message)s")
    torch.set_num_threads(threads)
    return work.run(chunks, _Timing(time.perf_counter()), start_lock=start_lock, stop=stop)


def _in_workers(work: _ShardWork, chunks: dict[int, list[dict]], timing: _Timing, bar) -> None:
    """:meth:`_ShardWork.run` over ``chunks`` in ``extract.workers`` spawned processes, shard i in worker i mod n.

    Each worker starts its own engines, one worker at a time (vLLM: its own instance, taking 1/n of the GPU memory
    fraction ``EAGLEPIPE_VLLM_ARGS`` asks for, see VLLMEngine's ``memory_share``) and a share of this process's
    torch threads, and writes its shards atomically. When a worker fails, the others finish the shard they are
    writing and begin no other; the first error is raised here, and a rerun resumes from the shards written
    (e.g. after instances that together asked for more GPU memory than there is failed at start). ``timing`` gets the slowest worker's
    seconds (the wall the stage waited) and every worker's tokens. On SmolLM2 at the CPU defaults, two workers
    of one thread wrote every tensor equal to one process of two (the shards' run key hashes the code, so compare
    runs of the same code), in 222 s against 183 s: on a CPU the workers only share its cores; they are for a GPU.
    """
    n = min(work.p.workers, len(chunks))
    parts = [{i: c for i, c in chunks.items() if i % n == r} for r in range(n)]
    parts = [part for part in parts if part]
    threads = max(1, torch.get_num_threads() // len(parts))
    log.info("extracting %d shards in %d worker processes", len(chunks), len(parts))
    ctx = multiprocessing.get_context("spawn")  # CUDA and vLLM cannot be forked
    work = replace(work, memory_share=1 / len(parts))
    with ctx.Manager() as manager, ProcessPoolExecutor(len(parts), mp_context=ctx) as pool:
        lock, stop = manager.Lock(), manager.Event()
        futures = {pool.submit(_worker, work, part, threads, lock, stop): part for part in parts}
        errors = []
        for f in as_completed(futures):
            if f.exception() is not None:
                errors.append(f.exception())
                stop.set()
                continue
            timing.absorb(f.result())
            bar.update(sum(len(c) for c in futures[f].values()))
    if errors:
        raise errors[0]


def _stats(manifest: dict, out_dir: Path, timing: _Timing, resumed: int, n_synthetic: int) -> ExtractStats:
    totals = manifest["totals"]
    nbytes = sum((out_dir / shard["file"]).stat().st_size for shard in manifest["shards"])
    return ExtractStats(
        samples=totals["samples"], tokens=totals["tokens"], loss_tokens=totals["loss_tokens"],
        seconds=time.perf_counter() - timing.t0, capture_seconds=timing.capture, generate_seconds=timing.generate,
        tokens_per_s=timing.tokens / timing.capture if timing.capture else 0.0,
        bytes_per_token=nbytes / max(totals["tokens"], 1), resumed_shards=resumed, quarantined=totals["quarantined"],
        synthetic=n_synthetic,
        synthetic_written=sum(is_synthetic(s["id"]) for s in manifest["samples"]),
        thinking=_thinking_totals(manifest["samples"]),
    )


def _thinking_totals(rows: list[dict]) -> dict | None:
    """Samples with thinking on / off, their reasoning and answer tokens and cut traces, summed over the manifest's
    sample rows (None when no sample was regenerated in a thinking mode)."""
    kinds = [r for r in rows if "thinking" in r]
    if not kinds:
        return None
    return {"on": sum(r["thinking"] for r in kinds), "off": sum(not r["thinking"] for r in kinds),
            **{k: sum(r[k] for r in kinds) for k in ("reasoning_tokens", "answer_tokens", "reasoning_cut")}}
