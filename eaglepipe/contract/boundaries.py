"""The one check of a boundary list h[k] that holds whatever the target: written once, for params and rules.

A leaf module (no project imports): :mod:`eaglepipe.params` (``layers`` in params.yaml) and
:mod:`eaglepipe.contract.convention` (any list of boundaries it translates) both ask it, each raising its own error
type. What depends on the target (k ≤ N, and N itself refused as an aux layer) is checked where N is known:
``params.check_layers_against_target`` and ``convention`` against the rule's N.
"""

from __future__ import annotations


def list_problem(boundaries: list) -> str | None:
    """What is wrong with ``boundaries`` as a list of h[k] indices, or None when nothing is.

    Engines concatenate the aux states in ascending layer order, each captured layer once
    (vLLM ``EagleModelMixin``, SGLang ``set_eagle3_layers_to_capture``), so the list must be non-empty,
    integers, unique, ascending and ≥ 0.
    """
    b = list(boundaries)
    if not b:
        return "is empty; give at least one boundary index, e.g. [2, 15, 27]"
    if any(not isinstance(k, int) or isinstance(k, bool) for k in b):
        return f"{b} must be integers"
    if len(set(b)) != len(b):
        return f"{b} has duplicates; each boundary h[k] may appear once"
    if b != sorted(b):
        return f"{b} is not ascending; engines concatenate aux states in ascending order"
    if b[0] < 0:
        return f"{b} has a negative boundary; allowed: 0 (embeddings) .. N (last layer)"
    return None
