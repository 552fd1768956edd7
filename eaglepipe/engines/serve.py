"""Served EAGLE-3 measurement, one for every serving engine: the draft served by the engine against the same
target served without it, greedy, same prompts and ``max_new_tokens``, at one or more batch sizes.

τ (mean acceptance length) = tokens produced per target forward, the bonus token included, prefill not
counted: the reference decoder's (:mod:`eaglepipe.serving.specdec`) definition. Each engine's figures come from its
own counters:

- vLLM: spec-decode Prometheus counters of ``LLM.get_metrics()`` (:func:`spec_counters`), differences of two
  snapshots around the timed requests: τ = 1 + accepted / drafts, acceptance at draft position i =
  accepted_per_pos[i] / drafts (:func:`vllm_acceptance`).
- SGLang: per-request ``meta_info`` (srt/managers/tokenizer_manager.py ``_calculate_spec_decoding_metrics``):
  τ = 1 + Σ spec_num_correct_drafts / Σ spec_verify_ct; acceptance at position i = verify steps that
  accepted ≥ i drafts / verify steps, from ``spec_correct_drafts_histogram`` (a chain, topk 1). SGLang's own
  ``spec_accept_length`` (completion_tokens / verify_ct, which counts the prefill's token) is reported beside
  it as ``tau_sglang_accept_length`` (:func:`spec_acceptance`).

The engines supply how to start a drafted instance and which counters to read
(:meth:`eaglepipe.engines.base.Engine.eagle3_args`, :meth:`~eaglepipe.engines.base.Engine.spec_figures`);
:func:`measure` is the rest.
"""

from __future__ import annotations

from pathlib import Path

# The figures of one timed (draft, plain) pair that differ by batch size.
_PER_BATCH = ("tau", "acceptance_per_pos", "tokens_per_s_draft", "tokens_per_s_plain", "speedup", "outputs_equal")


def serve_eagle3(
    name: str, target_dir: str | Path, draft_dir: str | Path, prompts: list[list[int]], k: int,
    max_new_tokens: int, engine=None, batch_sizes: tuple = (None,), subsets: dict[str, list[int]] | None = None,
    **engine_opts,
) -> dict:
    """Serve ``draft_dir`` with engine ``name``'s EAGLE-3 (k drafted tokens per step) and the target without it.

    Args:
        engine: an engine on ``target_dir`` to use (its running instance is replaced); default: a new one
            started with ``engine_opts`` (e.g. dtype, work_dir, llm_kwargs, engine_kwargs, log_level,
            max_total_tokens), closed at the end.
        batch_sizes: concurrency levels to time, each on the same two instances; the top-level figures are
            those of the first.
        subsets: {name: indices into ``prompts``}: each subset also served on its own with the draft (all at
            once), for its own τ (the counters are engine-wide, so a subset's figures need a run of their own).
    Returns:
        :func:`measure`'s dict.
    Raises:
        ServingUnavailable (before anything starts) where the engine cannot serve EAGLE-3 here.
    """
    from eaglepipe.engines import get_engine

    own = engine is None
    engine = engine or get_engine(name, target_dir, **engine_opts)
    try:
        return measure(engine, draft_dir, prompts, k, max_new_tokens, batch_sizes, subsets)
    finally:
        if own:
            engine.close()


def measure(engine, draft_dir: str | Path, prompts: list[list[int]], k: int, max_new_tokens: int,
            batch_sizes: tuple = (None,), subsets: dict[str, list[int]] | None = None) -> dict:
    """Time the drafted and the plain instance of ``engine`` at each batch size; one result (:func:`by_batch_size`).

    Returns a dict with k, tau, acceptance_per_pos, the engine's own counters (vLLM: drafts, draft_tokens,
    accepted_tokens; SGLang: tau_sglang_accept_length, accept_rate, verify_steps, histogram_steps),
    tokens_per_s_draft, tokens_per_s_plain, speedup, startup_s_draft, startup_s_plain, outputs_draft,
    outputs_plain, outputs_equal, prompts, max_new_tokens, engine_version, ``by_batch_size`` ({str(bs):
    the τ / speed / equality figures at that batch size}) when more than one batch size is timed, and
    ``by_subset`` ({name: τ, acceptance_per_pos, the counters, outputs_equal}) for each of ``subsets``, whose
    drafted outputs must equal the plain outputs of the same prompts for ``outputs_equal`` to stay true.
    """
    drafted = engine.eagle3_args(draft_dir, k)  # raises ServingUnavailable before any instance starts
    draft = [engine.generate_timed(prompts, max_new_tokens, batch_size=b, **drafted) for b in batch_sizes]
    parts = {name: engine.generate_timed([prompts[i] for i in idx], max_new_tokens, **drafted)
             for name, idx in (subsets or {}).items()}  # before the plain runs: one switch of instance
    plain = [engine.generate_timed(prompts, max_new_tokens, batch_size=b) for b in batch_sizes]
    runs = [{**serve_summary(k, len(prompts), max_new_tokens, drafted_run, plain_run, engine.version),
             **engine.spec_figures(drafted_run, k)} for drafted_run, plain_run in zip(draft, plain)]
    out = by_batch_size(runs, batch_sizes)
    if parts:
        out["by_subset"] = {name: {**engine.spec_figures(run, k), "outputs_equal": run["outputs"] == [
            plain[0]["outputs"][i] for i in subsets[name]]} for name, run in parts.items()}
        out["outputs_equal"] = out["outputs_equal"] and all(r["outputs_equal"] for r in out["by_subset"].values())
    return out


def serve_summary(k: int, n_prompts: int, max_new_tokens: int, draft: dict, plain: dict, version: str) -> dict:
    """The engine-independent part of a served-evaluation result.

    ``draft`` / ``plain``: the timed runs with and without the draft, each a dict with ``tokens_per_s``,
    ``startup_s`` and ``outputs`` (token ids per prompt). Engines add their own τ and acceptance fields.
    """
    return {
        "k": k,
        "prompts": n_prompts,
        "max_new_tokens": max_new_tokens,
        "tokens_per_s_draft": draft["tokens_per_s"],
        "tokens_per_s_plain": plain["tokens_per_s"],
        "speedup": draft["tokens_per_s"] / plain["tokens_per_s"],
        "startup_s_draft": draft["startup_s"],
        "startup_s_plain": plain["startup_s"],
        "outputs_draft": draft["outputs"],
        "outputs_plain": plain["outputs"],
        "outputs_equal": draft["outputs"] == plain["outputs"],
        "engine_version": version,
    }


def groups(items: list, size: int | None) -> list[list]:
    """``items`` in consecutive groups of ``size`` (the last may be shorter); one group when size is None."""
    if size is None:
        return [list(items)]
    if size < 1:
        raise ValueError(f"batch size must be ≥ 1 or None, got {size}")
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def by_batch_size(runs: list[dict], batch_sizes: tuple) -> dict:
    """One served result from the runs at each batch size: the first run's fields at the top level, and
    ``by_batch_size`` = {"1": {tau, acceptance_per_pos, tokens_per_s_*, speedup, outputs_equal}, ...}
    ("all" for None = every prompt at once) when more than one batch size was timed. ``outputs_equal`` at
    the top is true only when every run's draft and plain outputs are equal."""
    out = dict(runs[0])
    if len(runs) > 1:
        out["by_batch_size"] = {("all" if size is None else str(size)): {f: run[f] for f in _PER_BATCH if f in run}
                                for size, run in zip(batch_sizes, runs)}
        out["outputs_equal"] = all(run["outputs_equal"] for run in runs)
    return out


# ------------------------------------------------------------------------------------------------ vLLM


# vllm v1/spec_decode/metrics.py: counter name → our key (also read from /metrics text by serving/probe.py)
VLLM_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"  # one counter per draft position (label "position")


def spec_counters(llm) -> dict:
    """Cumulative speculative-decoding counters of a running ``vllm.LLM`` (needs ``disable_log_stats=False``).

    Returns {"drafts", "draft_tokens", "accepted", "per_pos": list[int]} summed over label sets. They are
    process-wide Prometheus counters: take differences of two snapshots (:func:`counter_delta`).
    """
    counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    for metric in llm.get_metrics():
        if metric.name in VLLM_COUNTERS:
            counters[VLLM_COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == VLLM_PER_POS:
            counters["per_pos"] = _vadd(counters["per_pos"], [int(v) for v in metric.values])
    return counters


def counter_delta(after: dict, before: dict) -> dict:
    """``after - before`` of two :func:`spec_counters` snapshots."""
    delta = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")}
    delta["per_pos"] = _vadd(after["per_pos"], before["per_pos"], -1)
    return delta


def _vadd(a: list[int], b: list[int], sign: int = 1) -> list[int]:
    """a + sign·b elementwise, the shorter one padded with zeros."""
    n = max(len(a), len(b))
    return [x + sign * y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]


def vllm_acceptance(counters: dict, k: int) -> dict:
    """τ and acceptance per position of one timed speculative run, from its vLLM counter differences."""
    drafts = max(counters["drafts"], 1)
    return {
        "tau": 1 + counters["accepted"] / drafts,
        "acceptance_per_pos": [a / drafts for a in counters["per_pos"][:k]],
        "drafts": counters["drafts"],
        "draft_tokens": counters["draft_tokens"],
        "accepted_tokens": counters["accepted"],
    }


def vllm_speculative_config(draft_dir: str | Path, k: int) -> dict:
    """vLLM's ``speculative_config`` that serves ``draft_dir`` with EAGLE-3, k drafted tokens per step."""
    return {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}


# ---------------------------------------------------------------------------------------------- SGLang


def spec_acceptance(meta: list[dict], k: int) -> dict:
    """τ and acceptance per draft position from SGLang's per-request ``meta_info`` (see the module docstring)."""
    verify = sum(m.get("spec_verify_ct", 0) for m in meta)
    correct = sum(m.get("spec_num_correct_drafts", 0) for m in meta)
    proposed = sum(m.get("spec_num_proposed_drafts", 0) for m in meta)
    completion = sum(m.get("completion_tokens", 0) for m in meta)
    hist = [0] * (k + 1)  # hist[a] = verify steps that accepted a drafts
    for m in meta:
        per_request = m.get("spec_correct_drafts_histogram") or m.get("spec_accept_histogram") or []
        for accepted, count in enumerate(per_request):
            hist[min(accepted, k)] += count
    steps = max(sum(hist), 1)
    return {
        "tau": 1 + correct / max(verify, 1),
        "tau_sglang_accept_length": completion / max(verify, 1),
        "acceptance_per_pos": [sum(hist[i:]) / steps for i in range(1, k + 1)],
        "accept_rate": correct / max(proposed, 1),
        "verify_steps": verify,
        "histogram_steps": sum(hist),
    }


def sglang_server_args(draft_dir: str | Path, k: int) -> dict:
    """SGLang server arguments that serve ``draft_dir`` with EAGLE-3, k drafted tokens per step (a chain)."""
    return {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": str(draft_dir),
        "speculative_num_steps": k,  # draft forward passes per step
        "speculative_eagle_topk": 1,  # a chain, not a tree: comparable with vLLM's k
        "speculative_num_draft_tokens": k + 1,  # the verified block: last accepted token + k drafts
    }
