"""EAGLE-3.1 draft variants: the config keys that switch them on, the tensors they add, which engine reads which.

    norm_before_fc        RMSNorm over the concatenated aux states before fc   tensor input_norm.weight (L·Ht,)
    fc_norm               one RMSNorm per aux state before fc                   tensors fc_norm.{l}.weight (Ht,)
    norm_before_residual  the draft layer's residual is hidden_norm(hidden)
    norm_output           the final norm's output, not its input, feeds the next draft step

vllm 0.32 ``model_executor/models/llama_eagle3.py`` reads all four from the draft's config (``getattr(config, key,
False)``; norm_before_fc also from ``eagle_config``). sglang 0.5.23 ``srt/models/llama_eagle3.py`` reads
norm_before_fc (``eagle_config`` first), fc_norm (or its older name ``use_aux_norm``) and norm_output, but not
norm_before_residual: its layer keeps the raw residual, so a draft trained with it is served as another model.
speculators 0.9.0 trains eagle3 drafts with norm_before_fc, norm_before_residual and norm_output on by default
(``speculators/train/config/schema.py``).
"""

from __future__ import annotations

from eaglepipe.errors import ParamsError

KEYS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")
TENSORS = {"norm_before_fc": "input_norm.weight", "fc_norm": "fc_norm.0.weight"}  # the tensor each adds
UNREAD = {  # engine → flag → where its code shows it is not read
    "sglang": {"norm_before_residual": "sglang 0.5.23 does not read norm_before_residual (srt/models/"
                                       "llama_eagle3.py LlamaDecoderLayer keeps the raw residual)"},
}


def combination_problem(norms: list[str]) -> str | None:
    """Why these flags cannot make one draft (a flag twice, or both fc norms), or None."""
    if len(set(norms)) != len(norms) or {"norm_before_fc", "fc_norm"} <= set(norms):
        return (f"{list(norms)}: each at most once, and norm_before_fc or fc_norm, not both: they are exclusive "
                "(vLLM's llama_eagle3.py builds one RMSNorm over the aux states or one per state)")
    return None


def config_flags(cfg: dict) -> list[str]:
    """The variant flags a draft ``config.json`` dict switches on (top level, or norm_before_fc in
    ``eagle_config``; fc_norm also under its older name ``use_aux_norm``), in :data:`KEYS` order."""
    nested = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    on = {k for k in KEYS if cfg.get(k)} | ({"norm_before_fc"} if nested.get("norm_before_fc") else set())
    on |= {"fc_norm"} if cfg.get("use_aux_norm") else set()
    return [k for k in KEYS if k in on]


def unserved(engine: str, flags: list[str]) -> str | None:
    """Why ``engine`` would serve a draft with these flags as another model than it was trained as, or None."""
    why = [UNREAD.get(engine, {})[f] for f in flags if f in UNREAD.get(engine, {})]
    return "; ".join(w + ": it would serve another draft than the one trained, silently" for w in why) or None


def require_served(framework: str, norms: list[str]) -> None:
    """Raise ParamsError (exit 2 at check_params) when the serving ``framework`` does not read one of
    ``train.draft_norms``: the draft would be served as another model than it is trained as, silently."""
    if framework != "hf" and (why := unserved(framework, list(norms))):
        raise ParamsError(f"train.draft_norms {list(norms)} with framework {framework}: {why}; drop "
                          "norm_before_residual or serve with vllm")


def judge(flags_by_engine: dict[str, list[str]], tensor_names: set[str]) -> tuple[list[str], list[str]]:
    """(problems, notes) of a draft folder: ``flags_by_engine`` = each loading engine's :func:`config_flags` of the
    config it builds; ``tensor_names`` = the folder's tensors (empty: not read). A flag whose tensor is missing,
    a norm tensor no flag switches on (the engine drops it and serves the draft without the norm it was trained
    with) and an engine that does not read a flag that is on are problems."""
    problems, notes = [], []
    flags = sorted({f for fl in flags_by_engine.values() for f in fl}, key=KEYS.index)
    if flags:
        notes.append("EAGLE-3.1 variant: " + ", ".join(flags))
    for flag, name in TENSORS.items():
        held = any(n == name or n.endswith("." + name) for n in tensor_names)
        if tensor_names and flag in flags and not held:
            problems.append(f"{flag} is set but the weights hold no {name}: the engines would start it at ones")
        if held and flag not in flags:
            problems.append(f"the weights hold {name} but the config does not set {flag}: the engines ignore the "
                            "tensor and serve the draft without the norm it was trained with")
    for engine, fl in flags_by_engine.items():
        if (why := unserved(engine, fl)) is not None:
            problems.append(f"{engine}: {why}")
    return problems, notes
