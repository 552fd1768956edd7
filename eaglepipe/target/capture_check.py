"""Can the engines the params name capture this target? Decided at the target stage, per engine, before any work.

An engine captures aux states from the target where the params make it:

- ``extract.engine`` captures the training features (with ``extract.store: tokens``, train_drafter captures
  them online through the same engine);
- ``framework``: validate_offsets re-captures through it, and serve_eval serves the draft with it (hf: the
  reference decoder, fed by the hf capture).

``extract.regenerate_engine`` only generates text, which every engine does for any target it loads, so it is
never refused here. An engine the params do not name is never refused: with ``framework: hf`` and
``extract.engine: hf`` neither SGLang nor vLLM is asked (export still leaves out the folder of an engine that
cannot feed the layers, saying why: :mod:`eaglepipe.serving.servable`).

Per engine, what decides:

- **vllm, sglang**: the engine's own code, through :func:`eaglepipe.contract.convention.rule_for` (the installed
  engine's capture table, :mod:`eaglepipe.contract.capture_support`, and the rule read from the class that
  captures): a class with no capture is refused naming the engine file.
- **hf**: eaglepipe's hooks (eaglepipe/engines/hf.py) sit on the decoder layers of transformers'
  ``AutoModelForCausalLM`` (a multimodal wrapper's language model: eaglepipe/target/hf_model.py); the target is
  built on the meta device (no weights, no memory) and must have its N
  decoder layers there.
"""

from __future__ import annotations

from pathlib import Path

from eaglepipe.contract import convention
from eaglepipe.errors import ConventionError, ParamsError
from eaglepipe.serving.servable import engine_version
from eaglepipe.target.hf_model import auto_class, decoder


def capture_uses(extract_engine: str, framework: str) -> dict[str, list[str]]:
    """Engine → the params that make it capture from the target (see the module docstring), in param order."""
    uses: dict[str, list[str]] = {}
    for param, engine in (("extract.engine", extract_engine), ("framework", framework)):
        uses.setdefault(engine, []).append(f"{param}: {engine}")
    return uses


def hf_layers_problem(config) -> str | None:
    """Why eaglepipe's hf capture cannot hook this target (a transformers config), or None when it can.

    Builds the model on the meta device (``AutoModelForCausalLM``, or ``AutoModelForImageTextToText`` for a
    multimodal wrapper: eaglepipe/target/hf_model.py) and looks for its decoder's ``layers`` holding N decoder
    layers, which eaglepipe/engines/hf.py hooks (``boundary_hooks``).
    """
    import torch

    n = getattr(config.get_text_config(), "num_hidden_layers", None)  # through the config's attribute_map (n_layer)
    try:
        with torch.device("meta"):
            model = auto_class(config).from_config(config)
    except (ValueError, KeyError, TypeError) as e:  # no causal-LM class for this config
        return (f"transformers has no AutoModelForCausalLM or AutoModelForImageTextToText for it "
                f"({str(e).splitlines()[0][:160]})")
    layers = getattr(decoder(model), "layers", None) if hasattr(model, "model") else None
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != n:
        size = f" of {len(layers)}" if hasattr(layers, "__len__") else ""
        found = "none" if layers is None else type(layers).__name__ + size
        return (f"{type(model).__name__} has no model.layers with its {n} decoder layers (found: {found}), which "
                f"eaglepipe/engines/hf.py hooks")
    return None


def capture_problems(config, engines: list[str]) -> dict[str, str]:
    """Engine → why it cannot capture the target of ``config`` (a transformers config), for ``engines``."""
    family = convention.family_of(config.to_dict())
    problems = {}
    for engine in engines:
        if engine == "hf":
            why = hf_layers_problem(config)
        else:
            try:
                convention.rule_for(engine, family, engine_version(engine))
                why = None
            except ConventionError as e:
                why = str(e)
        if why:
            problems[engine] = why
    return problems


def require_capturable(config, source: str, uses: dict[str, list[str]]) -> None:
    """Refuse (ParamsError, exit 2) a target one of the engines in ``uses`` cannot capture.

    ``uses``: :func:`capture_uses`. The message names each refusing engine, the params that ask for it, its
    reason (the engine file), and which engines could capture the target instead.
    """
    problems = capture_problems(config, list(uses))
    if not problems:
        return
    able = [e for e in convention.ENGINES if e not in problems and (e in uses or not capture_problems(config, [e]))]
    lines = [f"{', '.join(uses[e])}: {why}" for e, why in problems.items()]
    raise ParamsError(
        f"target.source {str(Path(source))!r} (model_type {config.model_type!r}) cannot be captured where the "
        f"params ask: " + "; ".join(lines) + f". Engines that can capture it: {', '.join(able) or 'none'}")
