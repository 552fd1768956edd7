"""`eaglepipe diagnose`: a tiny draft trained on h[2, 3, 4] is found trained there, whatever its folder says.

Target: a random 5-layer Llama with peaked next-token distributions; draft: 30 epochs on 400 tiny conversations
(their own answers, no regeneration), exported for vLLM; diagnosis on 32 of those conversations' assistant turns.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglepipe.cli import main
from eaglepipe.contract import draft_config
from eaglepipe.data.extract import extract
from eaglepipe.data.prompts import write_jsonl
from eaglepipe.params import ExtractParams, TrainParams
from eaglepipe.serving.diagnose import diagnose
from eaglepipe.serving.export import export_all
from eaglepipe.target.info import read_info
from eaglepipe.target.tiny import build, tiny_conversations
from eaglepipe.train.loop import train_drafter

TRAINED = [2, 3, 4]
CONVS = tiny_conversations(400)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(target folder, the vLLM exports of two drafts trained on h[2, 3, 4]: the defaults' EAGLE-3.1 norms, plain)."""
    root = tmp_path_factory.mktemp("diagnose")
    target = build("llama", root / "target", hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                   initializer_range=0.3)  # peaked next-token distributions; head_dim 32: vLLM's CPU attention's least
    p = ExtractParams(engine="hf", regenerate=False, batch_size=8, shard_size=64, dtype="float32", store="features")
    extract(CONVS, target, read_info(target), TRAINED, p, root / "features", root / "scratch", "h", gate_samples=2)
    tp = TrainParams(draft_vocab_size=64, ttt_steps=3, step_decay=0.8, epochs=30, lr=3e-3, warmup_steps=5,
                     batch_tokens=512, grad_accum=1, grad_clip=1.0, eval_fraction=0.1, checkpoint_every=1000, seed=0)
    train_drafter(root / "features", target, root / "drafter", tp, scratch_dir=root / "s")
    export_all(root / "drafter", target, root / "export", TRAINED, "vllm")
    plain = tp.model_copy(update={"draft_norms": []})  # the plain EAGLE-3 layer, the one ModelOpt writes
    train_drafter(root / "features", target, root / "plain", plain, scratch_dir=root / "s_plain")
    export_all(root / "plain", target, root / "export_plain", TRAINED, "vllm")
    return target, root / "export" / "vllm", root / "export_plain" / "vllm"


def _rewrite(src, dst, edit, rename=None, extra=None):
    """A copy of the folder ``src`` with its config edited by ``edit(cfg)`` and its tensors renamed / added."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(edit(cfg)))
    tensors = load_file(str(dst / "model.safetensors"))
    tensors = {(rename(k) if rename else k): v for k, v in tensors.items()} | (extra or {})
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _planted(cfg):
    """No lineage block; vLLM's and SGLang's ids each read as h[3, 4, 5]."""
    cfg.pop("eaglepipe")
    cfg[draft_config.TOP_FIELD] = [3, 4, 5]
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}
    return cfg


def _no_ids(cfg):
    for key in ("eaglepipe", "eagle_config", draft_config.TOP_FIELD):
        cfg.pop(key, None)
    return cfg


def _speculators(cfg):
    """speculators' own format: llama fields in transformer_layer_config, the flags it trains with stated."""
    llama = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size")}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 64,
            "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}},
            "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1, **llama},
            "norm_before_fc": True, "norm_output": True, "norm_before_residual": False,
            draft_config.TOP_FIELD: [1, 2, 3]}


def _modelopt(cfg):
    """ModelOpt's deployment export (modelopt/torch/export/plugins/hf_spec_export.py): llama fields at the top, the
    ids nested as its training hooks read them (a forward hook on layer i's output: h[i + 1]), no EAGLE-3.1 norms."""
    llama = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size")}
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "draft_vocab_size": 64, "tie_word_embeddings": False, **llama,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True,
                             "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                             "use_mtp_layernorm": False, "next_layer_regular": True, "parallel_draft_step": 1,
                             "parallel_draft_heads_num_layers": None}}


def _check(d, vllm_right):
    assert d.trained_on == TRAINED, d.verdict
    assert d.margin >= d.threshold > 0 and d.candidates[0].acceptance > 0.3
    assert d.engines["vllm"]["ids"] == TRAINED and d.engines["vllm"]["right"] is vllm_right


def test_the_exported_draft_is_found_trained_on_its_stated_boundaries(trained):
    target, export, _ = trained
    d = diagnose(export, target, CONVS, 32, text="conversation")
    _check(d, vllm_right=True)
    assert d.engines["sglang"] == {**d.engines["sglang"], "ids": [1, 2, 3], "right": True} and d.ok
    assert len(d.candidates) == 20  # every ascending triple of h[0..5]


def test_ids_planted_one_off_are_named_and_the_right_ones_written(trained, tmp_path, capsys):
    target, export, _ = trained
    folder = _rewrite(export, tmp_path / "planted", _planted)
    d = diagnose(folder, target, CONVS, 32, text="conversation")
    _check(d, vllm_right=False)
    assert d.engines["vllm"]["feeds"] == [3, 4, 5] and d.engines["sglang"]["ids"] == [1, 2, 3] and not d.ok
    write_jsonl(tmp_path / "convs.jsonl", CONVS[:32])
    rc = main(["diagnose", str(folder), "--target", str(target), "--prompts", str(tmp_path / "convs.jsonl"),
               "--prompts-n", "32", "--text", "conversation", "--vllm-version", "0.26.0"])
    out = capsys.readouterr().out
    assert rc == 1 and "trained on h[2, 3, 4]" in out  # the rules of the version asked, not the installed one's
    assert "vllm 0.26.0: WRONG, feeds h[3, 4, 5]; its config needs eagle_aux_hidden_state_layer_ids = [2, 3, 4]" in out


def test_a_folder_without_ids_is_searched(trained, tmp_path):
    target, export, _ = trained
    d = diagnose(_rewrite(export, tmp_path / "bare", _no_ids), target, CONVS, 32, text="conversation")
    _check(d, vllm_right=False)


def test_a_speculators_folder_is_read_in_its_own_names(trained, tmp_path):
    target, export, _ = trained
    folder = _rewrite(export, tmp_path / "spec", _speculators, rename=lambda k: k.replace("midlayer.", "layers.0."),
                      extra={"embed_tokens.weight": torch.zeros(99, 64)})
    d = diagnose(folder, target, CONVS, 32, text="conversation")
    assert d.draft_format == "speculators" and "sglang" in d.engines
    _check(d, vllm_right=False)
    assert d.engines["vllm"]["feeds"] == [1, 2, 3]


def test_a_modelopt_folder_is_read_in_its_own_names(trained, tmp_path):
    """ModelOpt names the layer ``layers.0.*``, writes no ``t2d`` and nests its ids [1, 2, 3]: SGLang adds 1 for Llama
    and feeds h[2, 3, 4], the trained set; vLLM's feed is not one answer (its V1 runner reads the nested ids as they
    are, its V2 runner ignores them), so the top-level field is what it needs."""
    target, _, plain = trained
    folder = _rewrite(plain, tmp_path / "modelopt", _modelopt, rename=lambda k: k.replace("midlayer.", "layers.0."))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "t2d"}, str(folder / "model.safetensors"))
    d = diagnose(folder, target, CONVS, 32, text="conversation")
    assert d.draft_format == "modelopt" and d.engines["sglang"]["right"] is True
    _check(d, vllm_right=False)
    assert d.engines["sglang"]["ids"] == [1, 2, 3] and d.engines["vllm"]["feeds"] is None
    assert (d.engines["vllm"]["field"], d.engines["vllm"]["ids"]) == (draft_config.TOP_FIELD, TRAINED)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_s_own_capture_finds_the_planted_draft_trained_on_h234(trained, tmp_path, capsys):
    """The same diagnosis on the states vLLM serves (its capture of h[0..5], fp32): the same set, the same ids,
    and the best set's acceptance within 0.02 of transformers' (the engines' fp32 states agree to ~1e-6)."""
    pytest.importorskip("vllm")
    target, export, _ = trained
    folder = _rewrite(export, tmp_path / "planted", _planted)
    by_hf = diagnose(folder, target, CONVS, 32, text="conversation")
    write_jsonl(tmp_path / "convs.jsonl", CONVS[:32])
    rc = main(["diagnose", str(folder), "--target", str(target), "--prompts", str(tmp_path / "convs.jsonl"),
               "--prompts-n", "32", "--text", "conversation", "--engine", "vllm", "--json"])
    d = json.loads(capsys.readouterr().out)  # the report alone: vLLM logs to stderr
    assert rc == 1 and d["trained_on"] == TRAINED and d["states"].startswith("vllm ")
    assert d["states"].endswith(" float32")
    assert d["margin"] >= d["threshold"] > 0 and len(d["candidates"]) == 20  # vLLM captures every h[0..5] of a Llama
    assert d["engines"]["vllm"]["ids"] == TRAINED and d["engines"]["vllm"]["right"] is False
    best, hf_best = d["candidates"][0], by_hf.candidates[0]
    assert best["positions"] == hf_best.positions and abs(best["acceptance"] - hf_best.acceptance) <= 0.02
