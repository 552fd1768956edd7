"""`eaglepipe inspect`: what would SGLang and vLLM feed this EAGLE-3 draft, on this target?

Reads a draft folder in any format found in the wild and checks it against a target ``config.json``:

- **format**: eaglepipe export (``eaglepipe`` block), SGLang/SpecForge (nested ``eagle_config`` ids),
  ModelOpt (nested ``eagle_config`` with its layernorm flags), speculators (``speculators_config``, top-level
  ids, llama fields in ``transformer_layer_config``), vLLM (top-level ids), original EAGLE-3
  (``LlamaForCausalLM``, ids hard-coded in its training code).
- **per engine**: the architecture it would build (SGLang 0.5.23: ``LlamaForCausalLMEagle3``,
  ``Eagle3DeepseekV2ForCausalLM`` only; vLLM 0.32: its registry's EAGLE-3 entries, after
  ``EAGLEConfig`` prefixes "Eagle3"), the ids it reads, the boundaries h[k] it feeds (via
  :mod:`eaglepipe.contract.convention`), and how many aux states its draft class sizes ``fc`` for.
- **weights** (:mod:`eaglepipe.contract.draft_weights`): ``fc.weight`` width vs ids × target hidden,
  ``lm_head.weight`` rows vs ``draft_vocab_size``, ``d2t``/``t2d``.

Each finding is a fact or a guess, and says which:

- **problem** (exit 1): what the folder and the engines' code prove breaks serving — an engine that loads the
  draft feeds other boundaries than the other engine or than the ``eaglepipe`` block states, fc or d2t that
  do not fit, no engine that loads the draft at all;
- **warning** (exit 0): what cannot be known from the folder — a draft RoPE other than the target's is right
  if the draft was trained with it (the engines build the draft's rotary embedding from the draft's own
  config), and only eaglepipe's own lineage block (``eaglepipe.rope``) says what it was trained with;
- **note**: information — e.g. no ids written where both engines feed the same default boundaries.

One verdict per engine: an engine that refuses the draft's architectures shows only that (no ids, no
boundaries); a refusal is a problem only when no engine loads the draft.

Nothing here imports torch, sglang or vllm.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from eaglepipe.contract import convention as conv
from eaglepipe.contract import draft_config, variants
from eaglepipe.contract.draft_weights import check_vocab, draft_tensors, find_tensor
from eaglepipe.engine_table import SERVING
from eaglepipe.errors import ConventionError, EaglepipeError
from eaglepipe.target.config import read_json, read_target_config
from eaglepipe.target.info import target_family

log = logging.getLogger(__name__)

# sglang 0.5.23: EntryClass of srt/models/llama_eagle3.py and kimi_k25_eagle3.py.
SGLANG_EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM")
# vllm 0.32: model_executor/models/registry.py entries served by llama_eagle3 / qwen3_eagle3 / deepseek_eagle3.
VLLM_EAGLE3_ARCHS = (
    "Eagle3LlamaForCausalLM",
    "LlamaForCausalLMEagle3",
    "Eagle3MiniMaxM2ForCausalLM",
    "Eagle3Qwen2_5vlForCausalLM",
    "Eagle3Qwen3vlForCausalLM",
    "Eagle3Qwen3ForCausalLM",
    "Eagle3DeepseekV2ForCausalLM",
    "Eagle3DeepseekV3ForCausalLM",
)
# vllm 0.32 transformers_utils/configs/speculators/algos.py update_eagle3: model_type -> architecture.
_VLLM_SPECULATORS_ARCH = {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}
_MODELOPT_KEYS = {"use_input_layernorm_in_first_layer", "use_last_layernorm", "use_mtp_layernorm", "parallel_draft_step"}


@dataclass
class EngineView:
    """What one engine would do with the draft."""

    engine: str  # "sglang" | "vllm"
    version: str  # the version whose rules were applied
    architecture: str | None  # the draft class it would build; None = it refuses the draft's architectures
    field: str | None  # where it reads the ids; None = no ids, engine default
    ids: list[int] | None  # ids as written in that field
    boundaries: list[int] | None  # h[k] it feeds, ascending; None = cannot be determined (see problems)
    fc_states: int | None  # aux states its draft class sizes fc for
    problems: list[str] = field(default_factory=list)
    served: bool = True  # False: an eaglepipe export that wrote no ids for this engine (it cannot express them)
    refused: str | None = None  # why it does not load the draft's architectures; None = it loads them

    @property
    def loads(self) -> bool:
        """The engine builds this draft and the folder is meant for it (not refused, not left out by export)."""
        return self.refused is None and self.served


@dataclass
class Report:
    """The result of :func:`inspect_draft`; ``ok`` is False when anything would break serving."""

    draft_dir: str
    draft_format: str  # eaglepipe | sglang/specforge | modelopt | speculators | vllm | eagle | unknown
    architectures: list[str]
    family: str
    n_layers: int
    target_hidden: int
    stated_boundaries: list[int] | None  # the eaglepipe block's aux_boundaries, if any
    engines: dict[str, EngineView]
    agree: bool | None  # SGLang and vLLM feed the same boundaries (None: one is unknown)
    fc_shape: tuple[int, int] | None  # fc.weight [H_draft, K·H_target]
    d2t: str  # one-line verdict on d2t/t2d
    problems: list[str] = field(default_factory=list)  # facts that break serving (exit 1)
    notes: list[str] = field(default_factory=list)  # information
    warnings: list[str] = field(default_factory=list)  # what the folder cannot tell (exit 0)

    @property
    def ok(self) -> bool:
        """No problem (warnings allowed): every engine that loads the draft serves it as stated."""
        return not self.problems and all(not v.problems for v in self.engines.values())


# --- files -------------------------------------------------------------------------------------------------


_load_json = read_json  # draft folders' config.json and friends: the same one-line errors as the target's


# --- the draft config as each engine sees it ---------------------------------------------------------------


def detect_format(cfg: dict) -> str:
    """Which tool wrote this draft config (see module docstring)."""
    nested = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    if "eaglepipe" in cfg:
        return "eaglepipe"
    if "speculators_config" in cfg or "speculators_model_type" in cfg:
        return "speculators"
    if _MODELOPT_KEYS & nested.keys():
        return "modelopt"
    if "eagle_aux_hidden_state_layer_ids" in nested:
        return "sglang/specforge"
    if draft_config.TOP_FIELD in cfg:
        return "vllm"
    archs = cfg.get("architectures") or []
    if archs == ["LlamaForCausalLM"]:
        return "eagle"
    if any("Eagle3" in a for a in archs):
        return "sglang/specforge"
    return "unknown"


def vllm_view(cfg: dict, fmt: str) -> dict:
    """The hf_config vLLM builds: speculators configs are rebuilt from transformer_layer_config (+ top ids)."""
    if fmt != "speculators":
        return cfg
    view = dict(cfg.get("transformer_layer_config") or {})
    for key in ("draft_vocab_size", "target_hidden_size", draft_config.TOP_FIELD):
        if cfg.get(key):
            view[key] = cfg[key]
    for key in variants.KEYS:  # vllm transformers_utils/configs/speculators/algos.py update_eagle3: residual on
        view[key] = cfg.get(key, key == "norm_before_residual")
    view["architectures"] = [_VLLM_SPECULATORS_ARCH.get(view.get("model_type", "llama"), "?")]
    return view


def _architecture(engine: str, archs: list[str]) -> str | None:
    for arch in archs:
        if engine == "sglang" and arch in SGLANG_EAGLE3_ARCHS:
            return arch
        if engine == "vllm":
            # transformers_utils/configs/eagle.py EAGLEConfig, method eagle3: prefix "Eagle3" unless present.
            name = arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"
            if name in VLLM_EAGLE3_ARCHS:
                return name
    return None


def _fc_states(engine: str, arch: str, cfg: dict) -> int:
    """How many aux states the engine's draft class sizes fc for (its own lookup order, from the source)."""
    nested = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    nested_ids = nested.get("eagle_aux_hidden_state_layer_ids")
    if engine == "sglang" and arch == "Eagle3DeepseekV2ForCausalLM":  # kimi_k25_eagle3._get_eagle_aux_layer_count
        ids = nested_ids if nested_ids is not None else cfg.get(draft_config.TOP_FIELD)
        return len(ids) if ids is not None else 3
    if engine == "vllm" and arch == "Eagle3Qwen3ForCausalLM":  # qwen3_eagle3.py
        for key in ("num_aux_layers", "num_aux_hidden_states"):
            if cfg.get(key) is not None:
                return cfg[key]
        ids = cfg.get(draft_config.TOP_FIELD) or nested_ids
        return len(ids) if ids else 3
    # sglang llama_eagle3.py, vllm llama_eagle3.py / deepseek_eagle3.py: explicit count > nested ids > 3.
    if cfg.get("num_aux_hidden_states") is not None:
        return cfg["num_aux_hidden_states"]
    return len(nested_ids) if nested_ids else 3


def _engine_view(engine: str, version: str, cfg: dict, family: str, n_layers: int) -> EngineView:
    """What ``engine`` builds from ``cfg`` and which boundaries it feeds; a refusal stops there (one verdict).

    An engine default (no ids where the engine reads them) is not judged here: :func:`_judge_defaults`
    decides once both engines are known.
    """
    view = EngineView(engine, version, _architecture(engine, cfg.get("architectures") or []), None, None, None, None)
    if view.architecture is None:
        accepted = SGLANG_EAGLE3_ARCHS if engine == "sglang" else VLLM_EAGLE3_ARCHS
        view.refused = (f"{engine} {version} does not load architectures {cfg.get('architectures')} as an "
                        f"EAGLE-3 draft; accepted: {list(accepted)}")
        return view
    view.fc_states = _fc_states(engine, view.architecture, cfg)
    try:
        runners = ("v1", "v2") if engine == "vllm" else (None,)
        fed = {}
        for runner in runners:
            ids, where = draft_config.config_ids(cfg, engine, runner)
            fed[runner] = (ids, where, draft_config.read_draft_boundaries(
                cfg, engine, family, n_layers, version, allow_default=True, runner=runner))
        view.ids, view.field, view.boundaries = fed[runners[-1]]
        if engine == "vllm" and fed["v1"][2] != fed["v2"][2]:
            view.problems.append(
                f"vLLM runners disagree: V1 reads {fed['v1'][1]} = {fed['v1'][0]} → h{fed['v1'][2]}, "
                f"V2 (default on CUDA) uses its default h{fed['v2'][2]}; write {draft_config.TOP_FIELD} at the top level"
            )
    except ConventionError as e:
        view.problems.append(str(e))
    if view.boundaries is not None and view.fc_states is not None and view.fc_states != len(view.boundaries):
        view.problems.append(
            f"{engine} feeds {len(view.boundaries)} aux states but its {view.architecture} sizes fc for "
            f"{view.fc_states} (num_aux_hidden_states, else the nested id list, else 3)"
        )
    return view


def _judge_defaults(engines: dict[str, EngineView], agree: bool | None, notes: list[str]) -> None:
    """An engine that loads the draft but finds no ids feeds its default boundaries. Where the engines that
    load it agree, that is information (a note); where they disagree it is the reason one of them serves
    other features (a problem of that engine)."""
    for v in engines.values():
        if not v.loads or v.field is not None or v.boundaries is None:
            continue
        if agree is False:
            v.problems.append(f"no ids where {v.engine} reads them: it silently feeds its default h{v.boundaries}")
            continue
        others = [o.engine for o in engines.values() if o is not v and o.loads]
        notes.append(f"{v.engine}: no ids written; it feeds its default h{v.boundaries}"
                     + (f", as {' and '.join(others)} does" if agree and others else ""))


def _mark_unserved(cfg: dict, engines: dict[str, EngineView], notes: list[str]) -> None:
    """An eaglepipe export lists the engines it wrote ids for (``eaglepipe.engines``); one it left out could not
    express the trained boundaries (export refused it, data/export/engines.json says why). Such a folder is
    not meant for that engine: what that engine would do with it is a note, not a problem of the folder."""
    block = cfg.get("eaglepipe") or {}
    written = block.get("engines")
    if not isinstance(written, dict) or not written:
        return
    for name, view in engines.items():
        if name not in written and view.refused is None:
            view.served = False
            notes.append(f"{name}: this eaglepipe export wrote no ids for {name} (it cannot express "
                         f"h{block.get('aux_boundaries')}; see the export's engines.json): not to be served by {name}"
                         + (f" (it would: {'; '.join(view.problems)})" if view.problems else ""))
            view.problems = []


# --- the report ------------------------------------------------------------------------------------------


def inspect_draft(
    draft_dir: str | Path, target_config: str | Path | dict, versions: dict[str, str] | None = None
) -> Report:
    """Inspect an EAGLE-3 draft folder against a target config (dict, folder or .json path).

    ``versions`` maps engine → version whose rules apply; default: the installed version, else the one the
    rules were verified against (:data:`eaglepipe.contract.convention.KNOWN_VERSIONS`). Raises EaglepipeError when
    the draft's config.json is missing/unreadable, when the folder is train_drafter's own output (no engine
    loads it: its export is what to inspect), or when the target's family is unknown.
    """
    draft_dir = Path(draft_dir)
    cfg = _load_json(draft_dir / "config.json")
    if isinstance(cfg.get("draft"), dict) and "layers" in cfg:  # draft.load_draft's format (train_drafter)
        raise EaglepipeError(
            f"{draft_dir} is train_drafter's output (trained on h{cfg['layers']}), eaglepipe's own format that "
            "no engine loads: inspect what the export stage made of it, data/export/vllm or data/export/sglang")
    target = target_config if isinstance(target_config, dict) else read_target_config(target_config)
    family, n_layers = target_family(target), conv.n_layers_of(target)
    target_hidden = conv.hidden_size_of(target)
    fmt = detect_format(cfg)
    problems: list[str] = []
    notes: list[str] = []
    warnings: list[str] = []
    engines, agree = _engine_verdicts(cfg, fmt, family, n_layers, versions or {}, problems, notes)
    _check_rope(vllm_view(cfg, fmt), target, cfg.get("eaglepipe") or {}, problems, warnings, notes)
    if fmt == "eagle":
        notes.append("original EAGLE-3 config: its training code hard-codes h[2], h[N//2], h[N-3]")
    draft_target_hidden = cfg.get("target_hidden_size")
    if draft_target_hidden is not None and draft_target_hidden != target_hidden:
        problems.append(f"draft target_hidden_size {draft_target_hidden} != target hidden_size {target_hidden}")
    target_vocab = target.get("vocab_size") or (target.get("text_config") or {}).get("vocab_size")
    fc_shape, d2t = _check_weights(draft_dir, cfg, engines, target_hidden, target_vocab, problems, notes)
    flags = {e: variants.config_flags(vllm_view(cfg, fmt) if e == "vllm" else cfg) for e, v in engines.items()
             if v.loads}
    more = variants.judge(flags, set(draft_tensors(draft_dir)))
    problems += more[0]
    notes += more[1]
    return Report(
        str(draft_dir), fmt, list(cfg.get("architectures") or []), family, n_layers, target_hidden,
        (cfg.get("eaglepipe") or {}).get("aux_boundaries"), engines, agree, fc_shape, d2t, problems, notes,
        warnings,
    )


def _engine_verdicts(cfg: dict, fmt: str, family: str, n_layers: int, versions: dict[str, str],
                     problems: list[str], notes: list[str]) -> tuple[dict[str, EngineView], bool | None]:
    """Each serving engine's view of the draft, and whether the engines that load it feed the same boundaries
    (None: fewer than two of them do, or one cannot be determined). Appends the cross-engine problems."""
    engines = {}
    for engine in sorted(SERVING):  # sglang, then vllm
        version = versions.get(engine) or conv.installed_version(engine) or conv.KNOWN_VERSIONS[engine]
        engine_cfg = vllm_view(cfg, fmt) if engine == "vllm" else cfg
        engines[engine] = _engine_view(engine, version, engine_cfg, family, n_layers)
    _mark_unserved(cfg, engines, notes)
    loading = [v for v in engines.values() if v.loads]
    if not loading:
        problems.append("no engine loads this draft: " + "; ".join(
            v.refused or f"{v.engine}: not exported for it" for v in engines.values()))
    fed = [v.boundaries for v in loading]
    agree = None if len(fed) < 2 or None in fed else all(b == fed[0] for b in fed)
    if agree is False:
        problems.append(", ".join(f"{'SGLang' if v.engine == 'sglang' else 'vLLM'} feeds h{v.boundaries}"
                                  for v in loading) + ": one of them serves other features")
    _judge_defaults(engines, agree, notes)
    stated = (cfg.get("eaglepipe") or {}).get("aux_boundaries")
    for v in loading:
        if stated is not None and v.boundaries is not None and v.boundaries != stated:
            problems.append(f"trained on h{stated} (eaglepipe block) but {v.engine} feeds h{v.boundaries}")
    return engines, agree


def _check_weights(draft_dir: Path, cfg: dict, engines: dict[str, EngineView], target_hidden: int,
                   target_vocab: int | None, problems: list[str], notes: list[str]) -> tuple[tuple | None, str]:
    """fc width against each loading engine's aux states, lm_head rows and d2t/t2d: ``(fc shape, d2t verdict)``."""
    tensors = draft_tensors(draft_dir)
    if not tensors:
        notes.append("no .safetensors in the draft folder: fc width and d2t not checked")
        return None, "d2t not read (no safetensors)"
    fc_shape = None
    fc = find_tensor(tensors, "fc.weight")
    if fc is None:
        problems.append("no fc.weight in the safetensors")
    else:
        fc_shape = tuple(fc["shape"])
        for v in engines.values():
            if not v.loads or v.boundaries is None:
                continue
            try:
                conv.check_fc_width(fc_shape[1], len(v.boundaries), target_hidden)
            except ConventionError as e:
                v.problems.append(f"{v.engine} feeds {len(v.boundaries)} states: {e}")
    draft_vocab = cfg.get("draft_vocab_size")
    lm_head = find_tensor(tensors, "lm_head.weight")
    if lm_head is not None and draft_vocab is not None and lm_head["shape"][0] != draft_vocab:
        problems.append(f"lm_head.weight has {lm_head['shape'][0]} rows, draft_vocab_size is {draft_vocab}")
    return fc_shape, check_vocab(tensors, draft_vocab, target_vocab, problems)


def _check_rope(draft_cfg: dict, target: dict, block: dict, problems: list[str], warnings: list[str],
                notes: list[str]) -> None:
    """The RoPE the engines build for the draft, against the one it was trained with where that is known.

    Both engines build the draft's rotary embedding from the draft's own config (vllm llama.py
    ``_init_rotary_emb``, sglang llama.py ``LlamaDecoderLayer``). What the draft was trained with is stated
    only by eaglepipe's lineage block (``eaglepipe.rope``, written by export): a config RoPE other than that
    is a problem. Without it, a RoPE other than the target's is a warning: right if the draft was trained
    with its config's RoPE (public drafts exist trained with rope_theta 10000 for llama3-scaled targets),
    wrong if it was trained with the target's — the folder cannot tell which.
    """
    from eaglepipe.model.rope import RopeError, rope_parameters

    tcfg = target.get("text_config") if isinstance(target.get("text_config"), dict) else target
    if not {"num_attention_heads", "hidden_size"} <= tcfg.keys():
        notes.append("target config has no attention shape: RoPE not checked")
        return
    try:
        want = rope_parameters(target)
    except RopeError as e:
        notes.append(f"target RoPE not checked: {e}")
        return
    if "num_attention_heads" not in draft_cfg or "hidden_size" not in draft_cfg:
        notes.append("draft config has no llama fields: RoPE not checked")
        return
    try:
        got = rope_parameters(draft_cfg)
    except RopeError as e:
        problems.append(f"draft RoPE: {e}")
        return
    trained = block.get("rope")
    if trained is not None and got != trained:
        problems.append(f"draft RoPE {got} differs from the one it was trained with, {trained} (eaglepipe block; "
                        f"the target's is {want}): the engines build it from this config, so it is served with "
                        "another RoPE than it was trained with and accepts little, silently")
    elif trained is not None and got != want:
        notes.append(f"draft RoPE {got}, as trained (eaglepipe block), differs from the target's {want}")
    elif got != want:
        warnings.append(f"draft RoPE {got} differs from the target's {want}: the engines build the draft's rotary "
                        "embedding from the draft's own config, right if it was trained with that RoPE; what it "
                        "was trained with cannot be read from its folder")


def _engine_line(v: EngineView) -> str:
    """One verdict per engine: refused, not exported for it, or what it builds and feeds."""
    head = f"{v.engine:<7} {v.version:<8} "
    if v.refused is not None:
        return head + "REFUSED: " + v.refused.split(" ", 2)[2]  # the reason, without the engine and version
    if not v.served:
        return head + f"not exported for {v.engine} (see the note)"
    fed = f"h{v.boundaries}" if v.boundaries is not None else "?"
    where = f"{v.field} = {v.ids}" if v.field else "no ids (default)"
    return (head + f"arch={v.architecture}  {where}  → feeds {fed}  "
            f"fc sized for {v.fc_states if v.fc_states is not None else '?'} states")


def format_report(report: Report) -> str:
    """The report as plain text, one fact per line: engine verdicts, notes, warnings, problems, then a summary
    ("OK", "OK for vllm only (sglang refuses it)", "…, 1 warning(s)" or "N problem(s)")."""
    lines = [
        f"draft    {report.draft_dir}  format={report.draft_format}  architectures={report.architectures}",
        f"target   family={report.family}  N={report.n_layers}  hidden={report.target_hidden}",
        f"convention  {conv.CONVENTION}",
    ]
    if report.stated_boundaries is not None:
        lines.append(f"trained on  h{report.stated_boundaries} (eaglepipe block)")
    lines += [_engine_line(v) for v in report.engines.values()]
    loading = [v.engine for v in report.engines.values() if v.loads]
    one = f"- (only {loading[0]} loads it)" if len(loading) == 1 else "?"
    lines.append(f"agree    {'yes' if report.agree else 'NO' if report.agree is False else one}")
    lines.append(f"fc       {list(report.fc_shape) if report.fc_shape else '?'}")
    lines.append(f"d2t      {report.d2t}")
    lines += [f"note     {n}" for n in report.notes]
    lines += [f"WARNING  {w}" for w in report.warnings]
    problems = report.problems + [problem for view in report.engines.values() for problem in view.problems]
    lines += [f"PROBLEM  {problem}" for problem in problems]
    warned = f", {len(report.warnings)} warning(s)" if report.warnings else ""
    if not report.ok:
        lines.append(f"{len(problems)} problem(s){warned}")
        return "\n".join(lines)
    refused = [v.engine for v in report.engines.values() if v.refused is not None]
    only = f" for {' and '.join(loading)} only ({' and '.join(refused)} refuses it)" if refused else ""
    lines.append(f"OK{only}{warned}")
    return "\n".join(lines)
