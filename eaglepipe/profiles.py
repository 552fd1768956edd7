"""Params profiles: YAML files of params.yaml keys (profiles/gpu.yaml) that DVC applies over params.yaml.

A profile holds some of params.yaml's keys, nested as there. :func:`profile_sets` turns it into ``dvc exp run``
arguments, ``-S key.path=value`` for each value it sets, so the stages run through DVC, as any experiment, on
params.yaml with the profile's values over it::

    dvc exp run $(eaglepipe profile profiles/gpu.yaml)
    dvc exp run $(eaglepipe profile profiles/gpu.yaml) -S prompts.synthetic=16000   # a value over the profile

Several profiles apply in order, a later one's value winning. ``-S`` reads Hydra's override grammar: strings are
written quoted (``"vllm"``, so ``"0"`` or ``"null"`` stay strings), lists as ``[1,8]``, null as ``null``. A key
that params.yaml lacks gets ``+`` (Hydra's "add"); params.yaml's own keys are overridden.

The profiles over params.yaml are validated (:func:`eaglepipe.params.parse_params`) before any argument is
returned, so a bad profile fails before DVC starts a stage.

Shell words: ``$(...)`` splits its output at whitespace, so it carries a profile whose values hold no spaces
(profiles/gpu.yaml). The arguments are printed one per line; for values with spaces (profiles/synthetic_topics.yaml)
pass the lines as they are: ``mapfile -t a < <(eaglepipe profile P); dvc exp run "${a[@]}"``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import yaml

from eaglepipe.errors import ParamsError


def leaves(profile: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every value ``profile`` sets: mappings are walked into, anything else (a list
    included) is one value: ``{"prompts": {"train": 8}, "layers": [2]}`` gives ``("prompts.train", 8)`` and
    ``("layers", [2])``."""
    out = []
    for k, v in profile.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out += leaves(v, f"{key}.")
        else:
            out.append((key, v))
    return out


def set_key(params: dict, dotted: str, value: Any) -> dict:
    """``params`` with the value at ``dotted`` (``section.key``) set, missing mappings created; in place."""
    *path, last = dotted.split(".")
    node = params
    for k in path:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    node[last] = value
    return params


def apply_sets(params: dict, sets: list[str]) -> dict:
    """``params`` with each ``key.path=VALUE`` of ``sets`` set (VALUE read as YAML: ``[1, 8]``, ``null``); in place."""
    for kv in sets:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise ParamsError(f"{kv!r}: expected key.path=VALUE")
        set_key(params, key, yaml.safe_load(value))
    return params


def merge_profile(params: dict, profile: dict) -> dict:
    """``profile``'s values over ``params`` (a mapping's keys merged, anything else replaced), in place."""
    for key, value in leaves(profile):
        set_key(params, key, value)
    return params


def override_value(value: Any, key: str = "value") -> str:
    """``value`` in the grammar of ``dvc exp run -S`` (Hydra's overrides); raises ParamsError for a value that
    the grammar cannot carry unchanged (a string with a backslash, a control character or ``${``, which Hydra
    would read as escapes or an interpolation)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else f"{'-' * (value < 0)}inf")
    if isinstance(value, str):
        if "\\" in value or "${" in value or any(ord(c) < 32 for c in value):
            raise ParamsError(f"{key} = {value!r}: a backslash, a control character or '${{' cannot pass "
                              "through dvc exp run -S unchanged; set it in params.yaml")
        if _yaml11_reads_otherwise(value):
            raise ParamsError(f"{key} = {value!r}: DVC writes this string unquoted (YAML 1.2) and params.yaml's "
                              f"reader (YAML 1.1) reads it back as {yaml.safe_load(value)!r}; set it in params.yaml")
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ",".join(override_value(v, key) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v, key)}" for k, v in value.items()) + "}"
    raise ParamsError(f"{key} = {value!r}: a {type(value).__name__} is not a params value")


def _yaml11_reads_otherwise(s: str) -> bool:
    """A string YAML 1.2 (ruamel, DVC's writer) leaves plain but YAML 1.1 (PyYAML, the stages' reader) reads as
    something else: yes/no/on/off in any case, and base-60 numbers (``12:30``)."""
    base60 = re.fullmatch(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?", s)
    return s.lower() in ("yes", "no", "on", "off") or base60 is not None


def _read(path: str | Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ParamsError(f"{path}: cannot read it as YAML: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ParamsError(f"{path}: a profile is a mapping of params.yaml keys (e.g. 'train: {{epochs: 3}}')")
    return data


def merged_params(*profile_paths: str | Path, params_path: str | Path = "params.yaml") -> dict:
    """params.yaml with the profiles' values over it, in order, validated (eaglepipe.params); raises ParamsError."""
    from eaglepipe.params import parse_params

    params = _read(params_path)
    for p in profile_paths:
        merge_profile(params, _read(p))
    try:
        parse_params(params)
    except ParamsError as e:
        names = " + ".join(str(p) for p in profile_paths)
        raise ParamsError(f"{names} over {params_path}:\n{e}") from None
    return params


def profile_sets(profile_path: str | Path, *more: str | Path, params_path: str | Path = "params.yaml") -> list[str]:
    """``dvc exp run`` arguments that apply ``profile_path`` (then each of ``more``) over ``params_path``:
    ``["-S", "key.path=value", ...]``, one pair per value set, in the profiles' order. The merged params are
    validated first: raises ParamsError (naming the key and the bad value) before returning anything."""
    merged_params(profile_path, *more, params_path=params_path)
    base = _read(params_path)
    sets: dict[str, Any] = {}
    for p in (profile_path, *more):
        sets.update(leaves(_read(p)))  # a later profile's value wins, in the first one's place
    args = []
    for key, value in sets.items():
        add = "" if _has(base, key) else "+"
        args += ["-S", f"{add}{key}={override_value(value, key)}"]
    return args


def _has(params: dict, dotted: str) -> bool:
    node: Any = params
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return False
        node = node[k]
    return True
