"""Export a trained draft as a folder each engine loads as is (``LlamaForCausalLMEagle3``).

Per engine: ``config.json`` (llama fields of the draft, ``draft_vocab_size``, ``target_hidden_size``, the aux
ids in that engine's meaning and place through :func:`eaglepipe.contract.draft_config.write_draft_ids` — and the other
serving engine's ids too, in its own meaning and place, so either engine loading either folder feeds the
trained layers — and an
``eaglepipe`` block stating the boundaries trained on and, as ``rope``, the RoPE trained with: the lineage
``eaglepipe inspect`` reads as fact) and ``model.safetensors`` with exactly ``fc.weight``,
``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64 offsets) and ``t2d`` (bool), plus
``input_norm.weight`` / ``fc_norm.{l}.weight`` for the EAGLE-3.1 variants that have them. The target's
embeddings are not exported: both engines share the target's.

Refusals (:class:`ExportError`) instead of a folder that loads but drafts garbage (a public converter once
saved random weights silently): a missing, unexpected or misshapen tensor, a d2t that maps outside the target
vocabulary or disagrees with t2d, and ids that do not translate back to the trained boundaries.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglepipe.atomic import atomic_dir, atomic_write_json
from eaglepipe.contract import convention, draft_config, variants
from eaglepipe.engine_table import SERVING as SERVING_ENGINES
from eaglepipe.errors import ConventionError, ExportError
from eaglepipe.model.draft import DraftConfig
from eaglepipe.model.rope import engine_fields as rope_fields
from eaglepipe.serving.servable import require_servable
from eaglepipe.target.config import read_target_config
from eaglepipe.target.info import TargetInfo, read_info

log = logging.getLogger(__name__)

ARCH = "LlamaForCausalLMEagle3"


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Name → (shape, dtype or None for any float) of every exported tensor."""
    H, I, Ht = cfg.hidden_size, cfg.intermediate_size, cfg.target_hidden_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    m = "midlayer."
    return {
        "fc.weight": ((H, cfg.n_aux * Ht), None),
        m + "hidden_norm.weight": ((H,), None),
        m + "input_layernorm.weight": ((H,), None),
        m + "self_attn.q_proj.weight": ((q, 2 * H), None),
        m + "self_attn.k_proj.weight": ((kv, 2 * H), None),
        m + "self_attn.v_proj.weight": ((kv, 2 * H), None),
        m + "self_attn.o_proj.weight": ((H, q), None),
        m + "post_attention_layernorm.weight": ((H,), None),
        m + "mlp.gate_proj.weight": ((I, H), None),
        m + "mlp.up_proj.weight": ((I, H), None),
        m + "mlp.down_proj.weight": ((H, I), None),
        "norm.weight": ((H,), None),
        "lm_head.weight": ((cfg.draft_vocab_size, H), None),
        "d2t": ((cfg.draft_vocab_size,), torch.int64),
        "t2d": ((cfg.vocab_size,), torch.bool),
        **({"input_norm.weight": ((cfg.n_aux * Ht,), None)} if cfg.norm_before_fc else {}),
        **({f"fc_norm.{i}.weight": ((Ht,), None) for i in range(cfg.n_aux)} if cfg.fc_norm else {}),
    }


def check_tensors(tensors: dict[str, torch.Tensor], cfg: DraftConfig) -> None:
    """Raise ExportError naming every missing, unexpected or misshapen tensor, or a d2t/t2d inconsistency."""
    want = expected_shapes(cfg)
    problems = [f"missing {n} {list(s)}" for n, (s, _) in want.items() if n not in tensors]
    problems += [f"unexpected {n} {list(t.shape)}" for n, t in tensors.items() if n not in want]
    for n, (shape, dtype) in want.items():
        t = tensors.get(n)
        if t is None:
            continue
        if tuple(t.shape) != shape:
            problems.append(f"{n}: shape {list(t.shape)}, expected {list(shape)}")
        elif dtype is not None and t.dtype != dtype:
            problems.append(f"{n}: dtype {t.dtype}, expected {dtype}")
        elif dtype is None and not t.is_floating_point():
            problems.append(f"{n}: dtype {t.dtype}, expected a float dtype")
        elif dtype is None and not torch.isfinite(t).all():
            problems.append(f"{n}: holds NaN/inf")
    if not problems:
        target_ids = torch.arange(cfg.draft_vocab_size) + tensors["d2t"]  # (Vd,) target ids
        if target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size:
            problems.append(f"d2t maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")
        elif not (target_ids[1:] > target_ids[:-1]).all():
            problems.append("d2t: target ids (draft id + d2t) are not strictly increasing")
        elif not torch.equal(tensors["t2d"].nonzero().flatten(), target_ids):
            problems.append("t2d does not mark exactly the target ids that d2t maps to")
    if problems:
        raise ExportError("refusing to export the draft:\n  " + "\n  ".join(problems))


def draft_config_json(cfg: DraftConfig, target_cfg: dict, dtype: str) -> dict:
    """The llama-style ``config.json`` of the draft (before the engine's aux ids are added).

    RoPE: the draft's (= the target's) ``rope_parameters`` plus ``rope_theta`` / ``rope_scaling``
    (:func:`eaglepipe.model.rope.engine_fields`): vllm 0.32 ``models/llama.py _init_rotary_emb`` and sglang 0.5.23
    ``models/llama.py LlamaDecoderLayer`` read ``config.rope_parameters``. The ``eaglepipe`` block starts with
    ``rope``, the resolved RoPE the draft was trained with (:attr:`DraftConfig.rope`); the ids added later
    keep it.
    """
    return {
        "architectures": [ARCH],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        **rope_fields(cfg.rope),  # the target's RoPE, in each spelling the engines read (rope.py)
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": target_cfg.get("bos_token_id"),
        "eos_token_id": target_cfg.get("eos_token_id"),
        "pad_token_id": target_cfg.get("pad_token_id"),
        "torch_dtype": dtype,
        "dtype": dtype,
        **dict.fromkeys(cfg.norms, True),  # EAGLE-3.1 flags: absent = off in both engines
        "eaglepipe": {"rope": cfg.rope},  # lineage: the RoPE it was trained with (inspect reads it as a fact)
    }


def export_draft(
    drafter_dir: Path, target_dir: Path, engine: str, out_dir: Path, layers: list[int], version: str | None = None,
    dtype: str = "float32", info: TargetInfo | None = None,
) -> dict:
    """Write ``out_dir`` (config.json + model.safetensors) for ``engine``; returns the config written.

    Args:
        drafter_dir: train_drafter's output (``config.json`` with the DraftConfig, ``model.safetensors``).
        layers: the boundaries the draft was trained on (h[k], ascending).
        version: the engine version the ids are written for (None = installed, else the translator's known).
        info: the target's :class:`TargetInfo` (default: read from ``target_dir``).
    Raises:
        ExportError: tensors missing/unexpected/misshapen, ids that do not round-trip to ``layers``, or a
            draft RoPE that is not the target's.
        ConventionError: the layers cannot be expressed for this engine / family / version.
    """
    drafter_dir, target_dir, out_dir = Path(drafter_dir), Path(target_dir), Path(out_dir)
    target_cfg = read_target_config(target_dir)  # token ids for the draft's config
    meta = json.loads((drafter_dir / "config.json").read_text())
    cfg = DraftConfig(**meta["draft"])
    info = info or read_info(target_dir, hash_weights=False)  # the one place the family comes from
    family, n_layers = info.family, info.n_layers
    if cfg.rope != info.rope:
        raise ExportError(f"the draft was trained with RoPE {cfg.rope} but the target's is {info.rope}: served "
                          f"with another RoPE than it was trained with it would accept little, silently; retrain")
    if cfg.n_aux != len(layers):
        raise ExportError(f"the draft's fc reads {cfg.n_aux} aux states but layers = {layers}")
    convention.check_fc_width(cfg.n_aux * cfg.target_hidden_size, len(layers), cfg.target_hidden_size)
    tensors = load_file(str(drafter_dir / "model.safetensors"))
    check_tensors(tensors, cfg)
    if (why := variants.unserved(engine, cfg.norms)) is not None:
        raise ExportError(f"refusing to export the draft for {engine}: {why}")
    config = draft_config_json(cfg, target_cfg, dtype)
    # The folder's own engine first (its ids must translate), then the other serving engine's ids too, each in
    # its meaning and place: a folder loaded by the "wrong" engine then still feeds the trained layers instead
    # of a silent default (or, for vLLM's V1 runner, SGLang's nested ids read without SGLang's +1).
    for eng in [engine] + [e for e in SERVING_ENGINES if e != engine]:
        ver = (version if eng == engine else None) or convention.installed_version(eng) \
            or convention.KNOWN_VERSIONS.get(eng)
        try:
            config = draft_config.write_draft_ids(config, eng, family, layers, n_layers, ver)
        except ConventionError as e:
            if eng == engine:
                raise
            log.warning("%s cannot serve this draft (%s); its ids are not written", eng, e)
            continue
        back = draft_config.read_draft_boundaries(config, eng, family, n_layers, ver)
        if back != list(layers):
            raise ExportError(f"{eng} {ver} would feed h{back} for this config, but the draft was trained on "
                              f"h{list(layers)}; refusing to export")
    cast = {n: (t.to(getattr(torch, dtype)) if t.is_floating_point() else t) for n, t in tensors.items()}
    if engine == "vllm" and cfg.draft_vocab_size == cfg.vocab_size:
        # vllm 0.32 model_executor/models/llama_eagle3.py creates draft_id_to_target_id (where load_weights puts
        # d2t) only when draft_vocab_size != vocab_size, and refuses the tensor otherwise; the mapping is the
        # identity then (check_tensors proved d2t all zeros), so the vLLM folder omits d2t and t2d.
        cast = {n: t for n, t in cast.items() if n not in ("d2t", "t2d")}
    with atomic_dir(out_dir) as tmp:
        save_file(cast, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", config)
    log.info("exported %s draft for %s: ids %s", family, engine,
             {e: v["ids"] for e, v in config["eaglepipe"]["engines"].items()})
    return config


def export_all(drafter_dir: Path, target_dir: Path, out_dir: Path, layers: list[int], framework: str) -> dict:
    """One folder per serving engine that can feed ``layers`` (``out_dir/<engine>``), and ``engines.json``.

    ``engines.json``: per engine ``{"exported": bool, "version", "ids"}``, plus ``reason`` and ``nearest``
    (layer lists it could serve) for an engine whose id rule cannot express ``layers``; its folder is absent.
    Raises ParamsError (exit 2) when the ``framework`` engine itself cannot feed ``layers``; ExportError /
    ConventionError as :func:`export_draft`.
    """
    drafter_dir, target_dir, out_dir = Path(drafter_dir), Path(target_dir), Path(out_dir)
    info = read_info(target_dir, hash_weights=False)
    plans = require_servable(framework, info.family, info.n_layers, layers)
    cfg = DraftConfig(**json.loads((drafter_dir / "config.json").read_text())["draft"])
    verdict = {}
    for engine, plan in plans.items():
        if (why := variants.unserved(engine, cfg.norms)) is not None:
            if engine == framework:
                raise ExportError(f"framework {engine}: {why}; serve with vllm or train without it")
            log.warning("no %s folder: %s", engine, why)
            shutil.rmtree(out_dir / engine, ignore_errors=True)
            verdict[engine] = {"exported": False, **plan.to_json(), "ids": None, "reason": why, "nearest": []}
            continue
        if plan.ids is None:
            log.warning("no %s folder: %s", engine, plan.message(layers, info.n_layers))
            shutil.rmtree(out_dir / engine, ignore_errors=True)
            verdict[engine] = {"exported": False, **plan.to_json()}
            continue
        export_draft(drafter_dir, target_dir, engine, out_dir / engine, layers, plan.version, info=info)
        verdict[engine] = {"exported": True, **plan.to_json()}
    atomic_write_json(out_dir / "engines.json", {"layers": list(layers), "family": info.family,
                                                 "n_layers": info.n_layers, "framework": framework,
                                                 "engines": verdict})
    return verdict
