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
- **weights** (safetensors header parsed in plain Python): ``fc.weight`` width vs ids × target hidden,
  ``lm_head.weight`` rows vs ``draft_vocab_size``; ``d2t``/``t2d`` values read with numpy when it is there:
  offsets in range, target ids = arange + d2t strictly increasing, identity = all zeros.

Nothing here imports torch, sglang or vllm.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path

from eaglepipe.contract import convention as conv
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
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(not v.problems for v in self.engines.values())


# --- files -------------------------------------------------------------------------------------------------


_load_json = read_json  # draft folders' config.json and friends: the same one-line errors as the target's


def safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file: {name: {"dtype", "shape", "data_offsets"}} (no torch)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    for meta in header.values():
        meta["_file"] = str(path)
        meta["_data_start"] = 8 + n
    return header


def _tensors(draft_dir: Path) -> dict:
    out: dict = {}
    for path in sorted(draft_dir.glob("*.safetensors")):
        out.update(safetensors_header(path))
    return out


def _find(tensors: dict, name: str) -> dict | None:
    for key, meta in tensors.items():
        if key == name or key.endswith("." + name):
            return meta
    return None


_NP_DTYPES = {"I64": "<i8", "I32": "<i4", "BOOL": "|b1", "U8": "|u1"}


def _read_values(meta: dict):
    """A 1-D tensor's values as a numpy array, or None when numpy is missing or the dtype is unexpected."""
    try:
        import numpy as np
    except ImportError:
        return None
    dtype = _NP_DTYPES.get(meta["dtype"])
    if dtype is None:
        return None
    start, end = meta["data_offsets"]
    with open(meta["_file"], "rb") as f:
        f.seek(meta["_data_start"] + start)
        return np.frombuffer(f.read(end - start), dtype=dtype)


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
    if conv.TOP_FIELD in cfg:
        return "vllm"
    archs = cfg.get("architectures") or []
    if archs == ["LlamaForCausalLM"]:
        return "eagle"
    if any("Eagle3" in a for a in archs):
        return "sglang/specforge"
    return "unknown"


def _vllm_view(cfg: dict, fmt: str) -> dict:
    """The hf_config vLLM builds: speculators configs are rebuilt from transformer_layer_config (+ top ids)."""
    if fmt != "speculators":
        return cfg
    view = dict(cfg.get("transformer_layer_config") or {})
    for key in ("draft_vocab_size", "target_hidden_size", conv.TOP_FIELD):
        if cfg.get(key):
            view[key] = cfg[key]
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
        ids = nested_ids if nested_ids is not None else cfg.get(conv.TOP_FIELD)
        return len(ids) if ids is not None else 3
    if engine == "vllm" and arch == "Eagle3Qwen3ForCausalLM":  # qwen3_eagle3.py
        for key in ("num_aux_layers", "num_aux_hidden_states"):
            if cfg.get(key) is not None:
                return cfg[key]
        ids = cfg.get(conv.TOP_FIELD) or nested_ids
        return len(ids) if ids else 3
    # sglang llama_eagle3.py, vllm llama_eagle3.py / deepseek_eagle3.py: explicit count > nested ids > 3.
    if cfg.get("num_aux_hidden_states") is not None:
        return cfg["num_aux_hidden_states"]
    return len(nested_ids) if nested_ids else 3


def _engine_view(engine: str, version: str, cfg: dict, family: str, n_layers: int) -> EngineView:
    view = EngineView(engine, version, _architecture(engine, cfg.get("architectures") or []), None, None, None, None)
    if view.architecture is None:
        accepted = SGLANG_EAGLE3_ARCHS if engine == "sglang" else VLLM_EAGLE3_ARCHS
        view.problems.append(
            f"{engine} {version} does not load architectures {cfg.get('architectures')} as an EAGLE-3 draft; "
            f"accepted: {list(accepted)}"
        )
    else:
        view.fc_states = _fc_states(engine, view.architecture, cfg)
    try:
        runners = ("v1", "v2") if engine == "vllm" else (None,)
        fed = {}
        for runner in runners:
            ids, where = conv.config_ids(cfg, engine, runner)
            fed[runner] = (ids, where, conv.read_draft_boundaries(
                cfg, engine, family, n_layers, version, allow_default=True, runner=runner))
        view.ids, view.field, view.boundaries = fed[runners[-1]]
        if view.field is None:
            view.problems.append(
                f"no ids where {engine} reads them: it silently feeds its default h{view.boundaries}"
            )
        if engine == "vllm" and fed["v1"][2] != fed["v2"][2]:
            view.problems.append(
                f"vLLM runners disagree: V1 reads {fed['v1'][1]} = {fed['v1'][0]} → h{fed['v1'][2]}, "
                f"V2 (default on CUDA) uses its default h{fed['v2'][2]}; write {conv.TOP_FIELD} at the top level"
            )
    except ConventionError as e:
        view.problems.append(str(e))
    if view.boundaries is not None and view.fc_states is not None and view.fc_states != len(view.boundaries):
        view.problems.append(
            f"{engine} feeds {len(view.boundaries)} aux states but its {view.architecture} sizes fc for "
            f"{view.fc_states} (num_aux_hidden_states, else the nested id list, else 3)"
        )
    return view


def _mark_unserved(cfg: dict, engines: dict[str, EngineView], notes: list[str]) -> None:
    """An eaglepipe export lists the engines it wrote ids for (``eaglepipe.engines``); one it left out could not
    express the trained boundaries (export refused it, data/export/engines.json says why). Such a folder is
    not meant for that engine: what that engine would do with it is a note, not a problem of the folder."""
    block = cfg.get("eaglepipe") or {}
    written = block.get("engines")
    if not isinstance(written, dict) or not written:
        return
    for name, view in engines.items():
        if name not in written:
            view.served = False
            notes.append(f"{name}: this eaglepipe export wrote no ids for {name} (it cannot express "
                         f"h{block.get('aux_boundaries')}; see the export's engines.json): not to be served by {name}"
                         + (f" (it would: {'; '.join(view.problems)})" if view.problems else ""))
            view.problems = []


# --- d2t / t2d -------------------------------------------------------------------------------------------


def _check_vocab(tensors: dict, draft_vocab: int | None, target_vocab: int | None, problems: list[str]) -> str:
    d2t_meta, t2d_meta = _find(tensors, "d2t"), _find(tensors, "t2d")
    if d2t_meta is None:
        if draft_vocab is not None and target_vocab is not None and draft_vocab < target_vocab:
            problems.append(f"no d2t tensor, but draft_vocab_size {draft_vocab} < target vocab {target_vocab}")
        return "d2t absent"
    if d2t_meta["dtype"] not in ("I64", "I32"):
        problems.append(f"d2t has dtype {d2t_meta['dtype']}; engines expect integer offsets (int64)")
        return "d2t not integer"
    if draft_vocab is not None and d2t_meta["shape"] != [draft_vocab]:
        problems.append(f"d2t shape {d2t_meta['shape']} != [draft_vocab_size] = [{draft_vocab}]")
    d2t = _read_values(d2t_meta)
    if d2t is None:
        return "d2t not read (numpy missing)"
    import numpy as np

    target_ids = np.arange(len(d2t), dtype=np.int64) + d2t.astype(np.int64)  # target_id = draft_id + d2t[draft_id]
    verdict = "identity (all zeros)" if not d2t.any() else f"offsets, {len(d2t)} draft tokens"
    bad = []
    if target_vocab is not None and (target_ids.min() < 0 or target_ids.max() >= target_vocab):
        bad.append(f"arange + d2t spans [{target_ids.min()}, {target_ids.max()}], outside [0, {target_vocab})")
        if d2t.min() >= 0 and d2t.max() < target_vocab and np.all(np.diff(d2t) > 0):
            bad.append("d2t looks like absolute target ids; engines add it to the draft id (offsets)")
    if len(target_ids) > 1 and not np.all(np.diff(target_ids) > 0):
        bad.append("arange + d2t is not strictly increasing (duplicate or unsorted target ids)")
    if t2d_meta is not None:
        t2d = _read_values(t2d_meta)
        if t2d is not None:
            if target_vocab is not None and len(t2d) != target_vocab:
                bad.append(f"t2d has {len(t2d)} entries, target vocab is {target_vocab}")
            elif int(t2d.sum()) != len(d2t):
                bad.append(f"t2d marks {int(t2d.sum())} tokens, d2t has {len(d2t)}")
            elif not bad and not t2d[target_ids].all():
                bad.append("t2d is False at some target id that d2t maps to")
    problems.extend(f"d2t: {b}" for b in bad)
    return "bad: " + "; ".join(bad) if bad else verdict


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
    target_vocab = target.get("vocab_size") or (target.get("text_config") or {}).get("vocab_size")
    fmt = detect_format(cfg)
    problems: list[str] = []
    notes: list[str] = []

    versions = dict(versions or {})
    engines = {}
    for engine in sorted(SERVING):  # sglang, then vllm
        version = versions.get(engine) or conv.installed_version(engine) or conv.KNOWN_VERSIONS[engine]
        engine_cfg = _vllm_view(cfg, fmt) if engine == "vllm" else cfg
        engines[engine] = _engine_view(engine, version, engine_cfg, family, n_layers)
    _mark_unserved(cfg, engines, notes)
    sgl, vll = (v.boundaries if v.served else None for v in (engines["sglang"], engines["vllm"]))
    agree = None if sgl is None or vll is None else sgl == vll
    if agree is False:
        problems.append(f"SGLang feeds h{sgl}, vLLM feeds h{vll}: one of them serves other features")

    stated = (cfg.get("eaglepipe") or {}).get("aux_boundaries")
    if stated is not None:
        for v in engines.values():
            if v.served and v.boundaries is not None and v.boundaries != stated:
                problems.append(f"trained on h{stated} (eaglepipe block) but {v.engine} feeds h{v.boundaries}")
    _check_rope(_vllm_view(cfg, fmt), target, problems, notes)
    if fmt == "eagle":
        notes.append("original EAGLE-3 config: its training code hard-codes h[2], h[N//2], h[N-3]")

    draft_target_hidden = cfg.get("target_hidden_size")
    if draft_target_hidden is not None and draft_target_hidden != target_hidden:
        problems.append(f"draft target_hidden_size {draft_target_hidden} != target hidden_size {target_hidden}")

    tensors = _tensors(draft_dir)
    fc_shape = None
    if not tensors:
        notes.append("no .safetensors in the draft folder: fc width and d2t not checked")
        d2t = "d2t not read (no safetensors)"
    else:
        fc = _find(tensors, "fc.weight")
        if fc is None:
            problems.append("no fc.weight in the safetensors")
        else:
            fc_shape = tuple(fc["shape"])
            for v in engines.values():
                if v.boundaries is None:
                    continue
                try:
                    conv.check_fc_width(fc_shape[1], len(v.boundaries), target_hidden)
                except ConventionError as e:
                    v.problems.append(f"{v.engine} feeds {len(v.boundaries)} states: {e}")
        draft_vocab = cfg.get("draft_vocab_size")
        lm_head = _find(tensors, "lm_head.weight")
        if lm_head is not None and draft_vocab is not None and lm_head["shape"][0] != draft_vocab:
            problems.append(f"lm_head.weight has {lm_head['shape'][0]} rows, draft_vocab_size is {draft_vocab}")
        d2t = _check_vocab(tensors, draft_vocab, target_vocab, problems)

    return Report(
        str(draft_dir), fmt, list(cfg.get("architectures") or []), family, n_layers, target_hidden,
        stated, engines, agree, fc_shape, d2t, problems, notes,
    )


def _check_rope(draft_cfg: dict, target: dict, problems: list[str], notes: list[str]) -> None:
    """The draft's RoPE must be the target's (type, theta, scaling): both engines build the draft's rotary
    embedding from its own config (vllm llama.py ``_init_rotary_emb``, sglang llama.py ``LlamaDecoderLayer``)."""
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
    if got != want:
        problems.append(f"draft RoPE {got} differs from the target's {want}: a draft served with another RoPE "
                        "than the target's accepts little, silently")


def format_report(report: Report) -> str:
    """The report as plain text, one fact per line, problems last."""
    lines = [
        f"draft    {report.draft_dir}  format={report.draft_format}  architectures={report.architectures}",
        f"target   family={report.family}  N={report.n_layers}  hidden={report.target_hidden}",
        f"convention  {conv.CONVENTION}",
    ]
    if report.stated_boundaries is not None:
        lines.append(f"trained on  h{report.stated_boundaries} (eaglepipe block)")
    for v in report.engines.values():
        fed = f"h{v.boundaries}" if v.boundaries is not None else "?"
        where = f"{v.field} = {v.ids}" if v.field else "no ids (default)"
        lines.append(
            f"{v.engine:<7} {v.version:<8} arch={v.architecture or 'REFUSED'}  {where}  → feeds {fed}  "
            f"fc sized for {v.fc_states if v.fc_states is not None else '?'} states"
            + ("" if v.served else "  (not exported for this engine)")
        )
    lines.append(f"agree    {'yes' if report.agree else 'NO' if report.agree is False else '?'}")
    lines.append(f"fc       {list(report.fc_shape) if report.fc_shape else '?'}")
    lines.append(f"d2t      {report.d2t}")
    lines += [f"note     {n}" for n in report.notes]
    problems = report.problems + [problem for view in report.engines.values() for problem in view.problems]
    lines += [f"PROBLEM  {problem}" for problem in problems]
    lines.append("OK" if report.ok else f"{len(problems)} problem(s)")
    return "\n".join(lines)
