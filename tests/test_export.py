"""export: engine folders with ids in each engine's meaning and place; refusals instead of broken folders."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglepipe.contract import draft_config
from eaglepipe.errors import ConventionError, ExportError
from eaglepipe.model.draft import DraftConfig, Eagle3Draft, save_draft
from eaglepipe.serving.export import export_draft


@pytest.fixture
def drafter(tmp_path, tiny_target):
    torch.manual_seed(0)
    cfg = DraftConfig.from_target(json.loads((tiny_target / "config.json").read_text()), n_aux=3, draft_vocab_size=40)
    draft = Eagle3Draft(cfg)
    target_ids = torch.arange(0, 80, 2)  # every other target token
    t2d = torch.zeros(99, dtype=torch.bool)
    t2d[target_ids] = True
    draft.set_vocab(target_ids - torch.arange(40), t2d)
    save_draft(draft, tmp_path / "drafter")
    return tmp_path / "drafter"


@pytest.mark.parametrize("engine,version,field,ids", [
    ("vllm", "0.32.0", "top", [1, 2, 3]),      # vLLM: id i = h[i]
    ("vllm", "0.33.0", "top", [1, 2, 3]),      # read from its wheel, not run: 0.32.0's capture code
    ("sglang", "0.5.23", "nested", [0, 1, 2]),  # SGLang llama: id i = h[i+1]
])
def test_export_per_engine(drafter, tiny_target, tmp_path, engine, version, field, ids):
    out = tmp_path / engine
    cfg = export_draft(drafter, tiny_target, engine, out, [1, 2, 3], version)
    on_disk = json.loads((out / "config.json").read_text())
    assert on_disk == cfg
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["vocab_size"]) == (40, 32, 99)
    got = cfg["eagle_aux_hidden_state_layer_ids"] if field == "top" else cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert got == ids and cfg["num_aux_hidden_states"] == 3
    assert cfg["eaglepipe"]["aux_boundaries"] == [1, 2, 3]
    assert draft_config.read_draft_boundaries(cfg, engine, "llama", 4, version) == [1, 2, 3]
    # the other engine's ids are written too, in its own meaning and place: both engines feed the trained layers
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    for eng, ver in (("vllm", "0.32.0"), ("sglang", "0.5.23")):
        assert draft_config.read_draft_boundaries(cfg, eng, "llama", 4, ver, runner="v2" if eng == "vllm" else None) \
            == [1, 2, 3]
    assert sorted(cfg["eaglepipe"]["engines"]) == ["sglang", "vllm"]
    w = load_file(out / "model.safetensors")
    assert "embed_tokens.weight" not in w and w["fc.weight"].shape == (32, 96)
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert (torch.arange(40) + w["d2t"]).tolist() == list(range(0, 80, 2))


def test_an_unread_engine_release_is_refused_with_the_command_that_reads_it(drafter, tiny_target, tmp_path):
    with pytest.raises(ConventionError, match=r"vllm 0\.34\.0 .*source was not read.*pip download --no-deps "
                                              r"vllm==0\.34\.0 .*capture_scan --wheel"):
        export_draft(drafter, tiny_target, "vllm", tmp_path / "vllm", [1, 2, 3], "0.34.0")
    assert not (tmp_path / "vllm").exists()


def test_refuses_bad_tensors(drafter, tiny_target, tmp_path):
    w = load_file(drafter / "model.safetensors")
    for mutate, msg in [
        (lambda t: t.pop("norm.weight"), "missing norm.weight"),
        (lambda t: t.update({"extra.weight": torch.zeros(2)}), "unexpected extra.weight"),
        (lambda t: t.update({"fc.weight": torch.zeros(32, 64)}), "fc.weight: shape [32, 64], expected [32, 96]"),
        (lambda t: t.update({"d2t": t["d2t"] + 60}), "outside the target vocabulary"),
        (lambda t: t.update({"t2d": torch.ones(99, dtype=torch.bool)}), "t2d does not mark exactly"),
    ]:
        bad = dict(w)
        mutate(bad)
        save_file(bad, str(drafter / "model.safetensors"))
        with pytest.raises(ExportError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            export_draft(drafter, tiny_target, "vllm", tmp_path / "out", [1, 2, 3], "0.32.0")
        assert not (tmp_path / "out").exists()
    save_file(w, str(drafter / "model.safetensors"))


def test_refuses_uncapturable_and_mismatched_layers(drafter, tiny_target, tmp_path):
    with pytest.raises(ConventionError):  # h[N] = h[4]: SGLang's llama cannot capture it
        export_draft(drafter, tiny_target, "sglang", tmp_path / "s", [1, 2, 4], "0.5.23")
    with pytest.raises(ExportError, match="reads 3 aux states"):
        export_draft(drafter, tiny_target, "vllm", tmp_path / "v", [1, 2], "0.32.0")


def test_eagle31_flags_and_norms_exported_where_the_engine_reads_them(tiny_target, tmp_path):
    """A draft with speculators' default EAGLE-3.1 flags: vLLM gets the flags as top-level keys and input_norm's
    weight; SGLang, which does not read norm_before_residual, gets no folder (refused, never served wrong)."""
    from eaglepipe.serving.export import export_all

    torch.manual_seed(0)
    cfg = DraftConfig.from_target(json.loads((tiny_target / "config.json").read_text()), n_aux=3, draft_vocab_size=99)
    cfg.norm_before_fc = cfg.norm_before_residual = cfg.norm_output = True
    save_draft(Eagle3Draft(cfg), tmp_path / "drafter")
    conf = export_draft(tmp_path / "drafter", tiny_target, "vllm", tmp_path / "vllm", [1, 2, 3], "0.32.0")
    assert {k: conf.get(k) for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")} == \
        {"norm_before_fc": True, "fc_norm": None, "norm_before_residual": True, "norm_output": True}
    assert load_file(tmp_path / "vllm" / "model.safetensors")["input_norm.weight"].shape == (96,)
    with pytest.raises(ExportError, match="norm_before_residual"):
        export_draft(tmp_path / "drafter", tiny_target, "sglang", tmp_path / "sglang", [1, 2, 3], "0.5.23")
    verdict = export_all(tmp_path / "drafter", tiny_target, tmp_path / "export", [1, 2, 3], "vllm")
    assert verdict["vllm"]["exported"] and not verdict["sglang"]["exported"]
    assert "norm_before_residual" in verdict["sglang"]["reason"] and not (tmp_path / "export" / "sglang").exists()
    with pytest.raises(ExportError, match="framework sglang"):
        export_all(tmp_path / "drafter", tiny_target, tmp_path / "export", [1, 2, 3], "sglang")
