"""Issue 12 on the lent H200: real vLLM 0.26 and SGLang 0.5.17 capture, validate and serve one exported draft.

Runs THERE (``lab/gpu_engines/suite.sh`` calls it, each engine in its own process and PYTHONPATH);
``merge`` runs HERE on what came back. Every step writes one JSON file into ``--out`` (the device's $OUT).

    prep       SmolLM2 target from the carried GGUF (fp32, as the CPU pipeline's), the carried draft/exports
    serve E    E in {vllm, sglang}: eaglepipe.engines.E.serve_eagle3 on MT-bench first turns, batch 1 and 8
    reference  the reference decoder (HF target + draft, fp32) on the same prompts
    extract E  E in {hf, vllm}: eaglepipe.data.extract on the carried training conversations → tokens/s
    validate E validate_offsets' check through engine E on the features extracted by vLLM
    crosscheck E  E in {vllm, sglang}: the seeds' kimi_k2 target through E against hf fp32 at every boundary
    seeds E    the seeds' case (item 5): tiny random kimi_k2 (DeepSeek-V3 MLA) target; E=vllm: extract its
               features with vLLM, train a few steps, export; E=sglang: SGLang's capture with the exported
               ids (offset 0) and with the seeds' ids planted (the gate names the shift and refuses), then
               SGLang EAGLE-3 serving of that draft
    merge      HERE: the step files → benchmarks/h200/serve_eval.json, offsets_sglang_deepseek.json,
               extract_engines.json
    env        THERE: ``export`` lines of the engine options in effect (gpu_env), for the product's scripts
    slim FILE... HERE: serve result files (suite.sh draft-vllm / draft-sglang / draft-extra) → benchmarks/h200/
               ``<stem><--tag>.json`` with counts instead of the 2 × prompts × max-new token ids
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

K = 3
LAYERS = [2, 15, 27]  # what the carried draft was trained on (params.yaml defaults)
SEEDS_LAYERS = [3, 4, 5]  # tiny kimi_k2, N = 6 (eaglepipe.target.tiny); the seeds' ids for these start at 2
# Engine options on the H200, defaults under what the environment already says (gpu_env). SGLang: FA3
# (flash_ops) is pruned from the carried sgl_kernel, hence triton attention.
GPU_VLLM = {"gpu_memory_utilization": 0.35}
GPU_SGLANG = {"attention_backend": "triton", "sampling_backend": "pytorch", "disable_cuda_graph": True,
              "mem_fraction_static": 0.35}
# SGLang variants for issue 13's speed-up (serve sglang --variant NAME): k, environment, server args over the ones in
# effect. Read in the 0.5.17 wheel (not yet run): at bs 1 its EAGLE-3 cycle (3.95 ms at τ 2.13, 13th window, against
# vLLM's ~2.1 ms) replays the draft, draft-extend and verify graphs with the triton backend, and no blocking sync but
# the previous batch's result copy, so it is host-bound. "trim": less host work per step (server_args.py's
# stream_interval and scheduler_recv_interval, default 1 each); "sim": SGLang's own acceptance simulation
# (environ.py SGLANG_SIMULATE_ACC_LEN, speculative/eagle_utils.py's verify: each step accepts 2.5 tokens on average,
# the draft's own tokens kept): the speed-up this target gets at τ 2.5, whatever the draft; its outputs are not greedy.
_TRIM = {"stream_interval": 16, "scheduler_recv_interval": 4}
_SIM25 = {"SGLANG_SIMULATE_ACC_LEN": "2.5", "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real-draft-token"}
SGLANG_VARIANTS = {"trim": (3, {}, _TRIM), "sim25": (3, _SIM25, {}), "sim25trim": (3, _SIM25, _TRIM),
                   "k5trim": (5, {}, _TRIM)}


def gpu_env() -> dict[str, dict]:
    """On a GPU: put GPU_VLLM / GPU_SGLANG under the stages' own variables (EAGLEPIPE_VLLM_ARGS,
    EAGLEPIPE_SGLANG_ARGS, JSON), which every engine eaglepipe starts reads (engines/vllm.py, engines/sglang.py),
    extract's and serve's too; values already there win (suite.sh's `pipeline` sets smaller memory shares).
    Returns engine name → the options in effect, for the result files."""
    import torch

    from eaglepipe.engines.sglang import SERVER_ARGS_ENV
    from eaglepipe.engines.vllm import LLM_ARGS_ENV

    out = {}
    for name, var, defaults in (("vllm", LLM_ARGS_ENV, GPU_VLLM), ("sglang", SERVER_ARGS_ENV, GPU_SGLANG)):
        opts = json.loads(os.environ.get(var) or "{}")
        if torch.cuda.is_available():
            opts = {**defaults, **opts}
            os.environ[var] = json.dumps(opts)
        out[name] = opts
    return out


def env(a) -> None:
    """Print ``export`` lines of the engine options gpu_env put in effect, for scripts that read only the
    environment (benchmarks/numerics.py, tests/test_gpu.py): ``eval "$(python3 lab/h200_engines.py env)"``."""
    import shlex

    from eaglepipe.engines.sglang import SERVER_ARGS_ENV
    from eaglepipe.engines.vllm import LLM_ARGS_ENV

    for var in (LLM_ARGS_ENV, SERVER_ARGS_ENV):
        if os.environ.get(var):
            print(f"export {var}={shlex.quote(os.environ[var])}")


def _write(out: Path, name: str, obj: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(obj, indent=2, default=str) + "\n")
    print(f"RESULT {name} {json.dumps(obj, default=str)[:1500]}", flush=True)


def _gpu() -> dict:
    import torch

    return {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__}


def prep(a) -> None:
    """Target folder from the GGUF (same dequantization as the CPU target stage) and the carried draft, if the
    inputs carry one (build.sh packs the GGUF alone when its checkout has no data/drafter: the GPU profile's
    draft-* steps need no other)."""
    from eaglepipe.target.info import materialize_target

    w = Path(a.work)
    t0 = time.perf_counter()
    if not (w / "target").exists():
        materialize_target(str(Path(a.inputs) / "SmolLM2-135M-Instruct.Q4_1.gguf"), w / "target", "float32")
    drafts = (("drafter", "drafter.json"), ("export/vllm", "vllm.json"), ("export/sglang", "sglang.json"))
    if not (Path(a.inputs) / "draft").is_dir():
        print(f"no draft in {a.inputs} (the GGUF alone): target only; serve/extract/validate need a carried draft")
        drafts = ()
    for name, cfg in drafts:
        d = w / name
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(a.inputs) / "draft" / cfg, d / "config.json")
        shutil.copy(Path(a.inputs) / "draft" / "model.safetensors", d / "model.safetensors")
    _write(Path(a.out), "prep.json", {"seconds": time.perf_counter() - t0, **_gpu()})


def _prompts(a) -> list[dict]:
    from transformers import AutoTokenizer

    from eaglepipe.data.prompts import read_jsonl
    from eaglepipe.serving.evaluate import eval_prompts

    recs = [r for r in read_jsonl(Path(a.inputs) / "prompts" / "eval.jsonl") if r.get("source") == a.source]
    if not recs:
        raise SystemExit(f"no {a.source!r} records in the carried eval.jsonl (prompts.mtbench / prompts.humaneval)")
    return eval_prompts(AutoTokenizer.from_pretrained(Path(a.work) / "target"), recs, a.prompts)


def serve(a) -> None:
    """One engine's EAGLE-3 serving against plain serving, batch sizes 1 and 8, counters from the engine."""
    w, prompts = Path(a.work), _prompts(a)
    ids = [p["input_ids"] for p in prompts]
    bs = (1, 8)
    if a.engine == "vllm":
        from eaglepipe.engines.vllm import serve_eagle3

        res = serve_eagle3(w / "target", w / "export" / "vllm", ids, a.k, a.max_new, batch_sizes=bs,
                           dtype=a.dtype, work_dir=w / "vllm-work")
        opts = {"enforce_eager": True, **a.gpu["vllm"]}
    else:
        from eaglepipe.engines.sglang import SERVER_ARGS_ENV, serve_eagle3

        if a.variant:  # before the engine starts: its processes read the environment
            a.k, env, args = SGLANG_VARIANTS[a.variant]
            os.environ.update(env)
            a.gpu["sglang"] = {**a.gpu["sglang"], **args}
            os.environ[SERVER_ARGS_ENV] = json.dumps(a.gpu["sglang"])
        res = serve_eagle3(w / "target", w / "export" / "sglang", ids, a.k, a.max_new, batch_sizes=bs,
                           dtype=a.dtype, log_level="warning")
        opts = a.gpu["sglang"]
        if a.variant:
            res.update(variant=a.variant, variant_env=env)
    res["outputs_draft"] = [list(o) for o in res["outputs_draft"]]
    res["outputs_plain"] = [list(o) for o in res["outputs_plain"]]
    _write(Path(a.out), f"serve_{a.engine}{a.tag}.json", {"engine": a.engine, "dtype": a.dtype, "engine_options": opts,
                                                   "prompt_ids": [p["id"] for p in prompts], **res, **_gpu()})


def reference(a) -> None:
    """The reference decoder (eaglepipe.serving.specdec through evaluate.reference_eval) on the same prompts."""
    from eaglepipe.serving.evaluate import reference_eval

    w, prompts = Path(a.work), _prompts(a)
    res = reference_eval(w / "target", w / "drafter", LAYERS, prompts, a.k, a.max_new, keep_outputs=True)
    _write(Path(a.out), f"reference{a.tag}.json", {"engine": "reference", "dtype": "float32",
                                           "prompt_ids": [p["id"] for p in prompts], **res, **_gpu()})


def extract_step(a) -> None:
    """Regenerate + capture the carried training conversations with one engine; tokens/s as reports/extract."""
    from dataclasses import asdict

    from eaglepipe.data.extract import extract
    from eaglepipe.data.prompts import read_jsonl
    from eaglepipe.params import ExtractParams
    from eaglepipe.target.info import read_info

    w = Path(a.work)
    info = read_info(w / "target")
    convs = read_jsonl(Path(a.inputs) / "prompts" / "train.jsonl")[: a.n]
    p = ExtractParams(engine=a.engine, regenerate=True, max_new_tokens=192, batch_size=96, max_length=1024,
                      dtype="bfloat16", shard_size=64)
    out = w / f"features-{a.engine}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    manifest, stats = extract(convs, w / "target", info, LAYERS, p, out, w / f"scratch-{a.engine}", "h200")
    _write(Path(a.out), f"extract_{a.engine}.json", {"engine": a.engine, "engine_version": manifest["engine_version"],
                                                     "conversations": len(convs), "wall_s": time.perf_counter() - t0,
                                                     **asdict(stats), **_gpu()})


def _check(engine_name: str, target: Path, features: Path, layers: list[int], planted=None, **opts) -> dict:
    """validate_offsets' check (eaglepipe.contract.validate.check_offsets) through a real engine; ``planted`` replaces
    the exporter's id translation (a function boundaries → ids) to show what the gate says of wrong ids."""
    from eaglepipe.contract import convention, validate
    from eaglepipe.data.features import FeatureSet
    from eaglepipe.engines import get_engine
    from eaglepipe.target.info import read_info

    info = read_info(target, hash_weights=False)
    fs = FeatureSet(features)
    real = convention.engine_ids
    if planted is not None:
        validate.convention.engine_ids = lambda eng, fam, ks, n, *r, **k: planted(ks) if eng == engine_name \
            else real(eng, fam, ks, n, *r, **k)
    try:
        with get_engine(engine_name, target, **opts) as e:
            rep = validate.check_offsets(e, info.family, info.n_layers, fs.layers, fs.take(2), 2, 0.999)
    finally:
        validate.convention.engine_ids = real
    return {"ok": rep.ok, "message": rep.message(), "compact": rep.compact(), "report": rep.to_json(),
            "ids": [r.engine_id for r in rep.layers]}


def validate_step(a) -> None:
    """Item 3: framework vllm / sglang validate_offsets on the H200, on the features vLLM extracted."""
    w = Path(a.work)
    res = _check(a.engine, w / "target", w / "features-vllm", LAYERS, dtype=a.dtype)
    _write(Path(a.out), f"validate_{a.engine}.json", {"engine": a.engine, "features": "vllm", **res, **_gpu()})


def seeds(a) -> None:
    """Item 5, the seeds' case: kimi_k2 target, features by vLLM, SGLang's capture and serving."""
    w = Path(a.work) / "seeds"
    if a.engine == "vllm":
        from benchmarks.support_matrix import _conversations
        from eaglepipe.data.extract import extract
        from eaglepipe.params import ExtractParams, TrainParams
        from eaglepipe.serving.export import export_all
        from eaglepipe.target.info import materialize_target
        from eaglepipe.target.tiny import build
        from eaglepipe.train.loop import train_drafter

        shutil.rmtree(w, ignore_errors=True)
        info = materialize_target(str(build("kimi_k2", w / "src")), w / "target")
        p = ExtractParams(engine="vllm", regenerate=False, batch_size=4, max_length=64, dtype="bfloat16",
                          engine_dtype="bfloat16", shard_size=8)  # vLLM's CUDA MLA kernels have no fp32
        manifest, _ = extract(_conversations(16), w / "target", info, SEEDS_LAYERS, p, w / "features",
                              w / "scratch", "seeds")
        tp = TrainParams(draft_vocab_size=64, epochs=2, batch_tokens=256, warmup_steps=1, eval_fraction=0.25)
        train_drafter(w / "features", w / "target", w / "drafter", tp, scratch_dir=w / "scratch_train")
        verdict = export_all(w / "drafter", w / "target", w / "export", SEEDS_LAYERS, "vllm")
        _write(Path(a.out), "seeds_vllm.json", {"family": info.family, "n_layers": info.n_layers,
                                                "source_model_type": "kimi_k2", "features_engine": manifest["engine"],
                                                "features_engine_version": manifest["engine_version"],
                                                "export": verdict, **_gpu()})
        return
    from eaglepipe.contract import draft_config

    exported_cfg = json.loads((w / "export" / "sglang" / "config.json").read_text())
    exported_ids = draft_config.config_ids(exported_cfg, "sglang")[0]
    ok = _check("sglang", w / "target", w / "features", SEEDS_LAYERS, dtype="bfloat16", max_total_tokens=2048)
    # The seeds' ids: "id i = output of decoder layer i" (what an exporter that writes Llama's SGLang ids
    # writes: boundary k → id k-1), read by SGLang's DeepSeek first-id rule, which adds +1 only when ids[0]==1.
    bad = _check("sglang", w / "target", w / "features", SEEDS_LAYERS, planted=lambda ks: [k - 1 for k in ks],
                 dtype="bfloat16", max_total_tokens=2048)
    served = None
    try:
        from transformers import AutoTokenizer

        from benchmarks.support_matrix import _conversations
        from eaglepipe.data.template import generation_prompt
        from eaglepipe.engines.sglang import serve_eagle3

        tok = AutoTokenizer.from_pretrained(w / "target")
        prompts = [generation_prompt(tok, c["messages"][:1]) for c in _conversations(8)]
        served = serve_eagle3(w / "target", w / "export" / "sglang", prompts, K, 32, dtype="bfloat16",
                              max_total_tokens=2048)
        served.pop("outputs_draft"), served.pop("outputs_plain")
    except Exception as e:  # noqa: BLE001 — recorded with its error, the offsets above stand on their own
        served = {"error": f"{type(e).__name__}: {str(e)[-2000:]}"}
    _write(Path(a.out), "seeds_sglang.json", {"exported_ids": exported_ids, "exported": ok,
                                              "planted_ids": bad["ids"], "planted": bad, "served": served, **_gpu()})


def crosscheck_rows(engine_name: str, target: Path, bounds: list[int], **engine_opts) -> dict:
    """``target`` through hf fp32 (the reference) and engine ``engine_name`` in bf16 at boundaries ``bounds``
    (ids in the engine's meaning, eaglepipe.contract.convention), on 4 chat-templated conversations: per boundary the
    gate's cosine and relative L2 (eaglepipe.contract.validate.cosine_rel_l2) and the norm ratio engine / hf."""
    import torch
    from transformers import AutoTokenizer

    from benchmarks.support_matrix import _conversations
    from eaglepipe.contract import convention
    from eaglepipe.contract.validate import cosine_rel_l2
    from eaglepipe.engines import get_engine
    from eaglepipe.engines.hf import HFEngine
    from eaglepipe.target.info import read_info

    info = read_info(target, hash_weights=False)
    tok = AutoTokenizer.from_pretrained(target)
    seqs = [tok(tok.apply_chat_template(c["messages"][:1], tokenize=False))["input_ids"] for c in _conversations(4)]
    ref = torch.cat(HFEngine(target, dtype="float32").capture(seqs, bounds))  # (ΣT, B, H)
    with get_engine(engine_name, target, dtype="bfloat16", info=info, **engine_opts) as e:
        got = torch.cat(e.capture(seqs, convention.ids_reading_as(engine_name, info.family, bounds, info.n_layers)))
        version = e.version
    rows = []
    for j, k in enumerate(bounds):
        cos, rel = cosine_rel_l2(ref[:, j], got[:, j])
        rows.append({"boundary": k, "cosine": cos, "rel_l2": rel,
                     "norm_ratio": (got[:, j].norm() / ref[:, j].norm()).item()})
    return {"engine": engine_name, "engine_version": version, "dtype": "bfloat16", "reference": "hf float32",
            "family": info.family, "tokens": int(ref.shape[0]), "layers": rows}


def crosscheck(a) -> None:
    """The seeds' target through hf (fp32, the reference) and engine ``a.engine`` at every boundary it captures
    from h[2] on: which engine departs from transformers' DeepSeek-V3 (the seeds' case found vLLM's features and
    SGLang's capture at cosine 0.24-0.38 on the H200). Needs the target of ``seeds vllm`` (built here if absent)."""
    from eaglepipe.contract import convention
    from eaglepipe.target.info import materialize_target, read_info
    from eaglepipe.target.tiny import build

    w = Path(a.work) / "seeds"
    if not (w / "target" / "config.json").exists():
        materialize_target(str(build("kimi_k2", w / "src")), w / "target")
    info = read_info(w / "target", hash_weights=False)
    bounds = sorted(set(range(2, info.n_layers)) & set(convention.capturable(a.engine, info.family, info.n_layers)))
    opts = {"max_total_tokens": 2048} if a.engine == "sglang" else {}
    _write(Path(a.out), f"crosscheck_{a.engine}.json", {**crosscheck_rows(a.engine, w / "target", bounds, **opts),
                                                        **_gpu()})


_FIELDS = ("tau", "acceptance_per_pos", "outputs_equal", "engine_version", "dtype", "prompts", "max_new_tokens",
           "tokens_per_s_draft", "tokens_per_s_plain", "speedup", "startup_s_draft", "startup_s_plain",
           "engine_options", "tau_sglang_accept_length", "accept_rate", "drafts", "accepted_tokens",
           "verify_steps", "device", "prompts_equal", "rounds", "new_tokens", "prompt_ids")


def _row(r: dict, name: str, greedy: dict) -> dict:
    """One engine's entry of serve_eval.json; ``greedy``: prompt id → the reference decoder's greedy output."""
    row = {k: r[k] for k in _FIELDS if k in r}
    if name.startswith("reference"):
        row["engine_version"] = "eaglepipe specdec (HF transformers target, fp32)"
        row["speedup_bs1"], row["speedup_bs8"] = r.get("speedup"), None
        return row
    by = r.get("by_batch_size", {})
    row.update(speedup_bs1=by.get("1", {}).get("speedup"), speedup_bs8=by.get("8", {}).get("speedup"), by_batch_size=by)
    # a shorter run (SGLang's 64 new tokens) is compared with the same number of the reference's tokens
    same = [list(greedy[i][:len(o)]) == list(o) for i, o in zip(r["prompt_ids"], r["outputs_plain"])
            if i in greedy and len(o) <= len(greedy[i])]
    row["plain_equal_to_reference_greedy"] = f"{sum(same)}/{len(same)}" if same else "reference outputs not kept"
    row["outputs"] = {"draft": r["outputs_draft"], "plain": r["outputs_plain"]}
    return row


def merge(a) -> None:
    """HERE: the device's step files (``--out``) → the committed benchmarks/h200/*.json.

    ``notes.json`` in ``--out`` (written by hand from the call logs) records what did not run and why.
    """
    src, dst = Path(a.out), REPO / "benchmarks" / "h200"
    load = lambda n: json.loads((src / n).read_text()) if (src / n).exists() else None  # noqa: E731
    notes = load("notes.json") or {}
    out = {"produced_by": "lab/gpu_engines/suite.sh + python lab/h200_engines.py merge", "k": K,
           **{k: v for k, v in notes.items() if k not in ("not_run", "extract", "validate", "seeds", "seeds_notes")}}
    refs = [r for r in (load("reference.json"), load("reference_cpu.json")) if r]
    greedy = {i: o for r in refs for i, o in zip(r["prompt_ids"], r.get("outputs_greedy", []))}
    for name, f in (("vllm", "serve_vllm.json"), ("sglang", "serve_sglang.json"), ("reference", "reference.json"),
                    ("reference_cpu", "reference_cpu.json")):
        r = load(f)
        if r is not None:
            out[name] = _row(r, name, greedy)
        elif name in notes.get("not_run", {}):
            out[name] = {"not_run": notes["not_run"][name]}
    (dst / "serve_eval.json").write_text(json.dumps(out, indent=2) + "\n")
    seeds_s, seeds_v = load("seeds_sglang.json"), load("seeds_vllm.json")
    if seeds_s:
        from eaglepipe.params import ValidateParams

        floor = ValidateParams().min_match_cosine
        for case in ("exported", "planted"):  # the gate's verdict rule of today, from the recorded cosines
            best = [r["best_cosine"] for r in seeds_s[case]["report"]["layers"]]
            seeds_s[case]["verdict_now"] = "mismatch" if min(best) < floor else seeds_s[case]["compact"]["verdict"]
        cross = {e: load(f"crosscheck_{e}.json") for e in ("vllm", "sglang") if load(f"crosscheck_{e}.json")}
        (dst / "offsets_sglang_deepseek.json").write_text(json.dumps({"target": seeds_v, **seeds_s,
                                                                      "crosscheck_against_hf": cross or None,
                                                                      "notes": notes.get("seeds_notes")},
                                                                     indent=2) + "\n")
    ex = {e: load(f"extract_{e}.json") or {"not_run": notes.get("extract", {}).get(e)} for e in ("hf", "vllm")}
    val = {e: load(f"validate_{e}.json") or {"not_run": notes.get("validate", {}).get(e)} for e in ("vllm", "sglang")}
    seeds = {"vllm": seeds_v or {"not_run": notes.get("seeds", {}).get("vllm")},
             "sglang": seeds_s or {"not_run": notes.get("seeds", {}).get("sglang")}}
    (dst / "extract_engines.json").write_text(json.dumps({"extract": ex, "validate_offsets": val, "seeds": seeds,
                                                          "checks": {e: load(f"check_{e}.json") for e in ("vllm", "sglang")}},
                                                         indent=2) + "\n")
    print(json.dumps({k: {f: v.get(f) for f in ("tau", "speedup_bs1", "speedup_bs8", "outputs_equal", "not_run")}
                      for k, v in out.items() if isinstance(v, dict)}, indent=1))


def _first_differences(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Index of the first differing token of each pair of outputs that differ (sorted)."""
    return sorted(next((j for j, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
                  for p, q in zip(a, b) if p != q)


def slim(a) -> None:
    """HERE: serve result files (the paths after ``slim``) → ``--dest``/``<stem><--tag>.json``, token ids
    dropped: ``outputs_equal_count`` (drafted = the same engine's plain greedy at batch size 1, "n/prompts"), the
    first differing token of the pairs that differ, and, for a file of another engine on the same prompts in the
    same dtype, ``plain_equal_to_the_other_engine_plain``. ``--note`` is kept as ``note``."""
    runs = {Path(f): json.loads(Path(f).read_text()) for f in [a.engine, *a.files] if f}
    outs = {f: (r.pop("outputs_draft"), r.pop("outputs_plain")) for f, r in runs.items()}
    for f, r in runs.items():
        d, p = outs[f]
        first = _first_differences(d, p)
        r.update(outputs_equal_count=f"{len(d) - len(first)}/{len(d)}", first_differences_at_token=first)
        for g, o in runs.items():
            if o["engine"] != r["engine"] and (o["prompt_ids"], o["dtype"]) == (r["prompt_ids"], r["dtype"]):
                same = sum(x == y for x, y in zip(p, outs[g][1]))
                r["plain_equal_to_the_other_engine_plain"] = f"{same}/{len(p)} ({o['engine']}, {o['dtype']})"
        if a.note:
            r["note"] = a.note
        out = Path(a.dest) / f"{f.stem}{a.tag}.json"
        out.write_text(json.dumps(r, indent=1) + "\n")
        print(out, {k: r.get(k) for k in ("tau", "speedup", "outputs_equal_count")})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["prep", "serve", "reference", "extract", "validate", "seeds", "crosscheck",
                                     "merge", "slim", "env"])
    ap.add_argument("engine", nargs="?", default=None)
    ap.add_argument("files", nargs="*", help="slim: the serve result files")
    ap.add_argument("--note", default="", help="slim: a note kept in each file")
    ap.add_argument("--dest", default=str(REPO / "benchmarks" / "h200"), help="slim: where the slim files go")
    ap.add_argument("--work", default="/tmp/w")
    ap.add_argument("--inputs", default="/tmp/eng/inputs")
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--prompts", type=int, default=32, help="eval prompts served (of --source)")
    ap.add_argument("--source", default="mtbench", help="eval.jsonl source served: mtbench | humaneval")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--dtype", default=None, help="serving dtype; default float32 for vllm, bfloat16 for sglang "
                    "(sgl_kernel's rmsnorm has no float32 kernel: 'failed to dispatch data type Float', seen on the H200)")
    ap.add_argument("--n", type=int, default=128, help="training conversations extracted")
    ap.add_argument("--k", type=int, default=K, help="drafted tokens per step (serve, reference)")
    ap.add_argument("--tag", default="", help="suffix of the serve/reference result file (e.g. _k5_humaneval)")
    ap.add_argument("--variant", default="", choices=["", *SGLANG_VARIANTS],
                    help="serve sglang: one of SGLANG_VARIANTS (its k, environment and server args)")
    a = ap.parse_args()
    a.dtype = a.dtype or ("bfloat16" if a.engine == "sglang" else "float32")
    a.gpu = gpu_env()
    steps = {"prep": prep, "serve": serve, "reference": reference, "extract": extract_step,
             "validate": validate_step, "seeds": seeds, "crosscheck": crosscheck, "merge": merge, "slim": slim,
             "env": env}
    steps[a.step](a)


if __name__ == "__main__":
    main()
