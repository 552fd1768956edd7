"""validate_offsets' comparison on the hf engine: planted translator offsets −2..+2 are named exactly."""

import re

import pytest
import torch

from eaglepipe import convention
from eaglepipe.engines.hf import HFEngine
from eaglepipe.errors import CaptureMismatch
from eaglepipe.features import FeatureSample
from eaglepipe.validate import check_offsets, require_ok

SEQS = [[5, 17, 33, 2, 90, 4, 61, 7], [7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def engine(tiny_target):
    return HFEngine(tiny_target)


@pytest.fixture(scope="module")
def stored(engine):
    """Samples 'extracted' at boundaries [2] (N = 4), stored in bfloat16 like the default."""
    caps = engine.capture(SEQS, [2, 4])
    return [FeatureSample(f"s{i}", torch.tensor(s), torch.ones(len(s), dtype=torch.bool),
                          c[:, :1].bfloat16(), c[:, 1].bfloat16()) for i, (s, c) in enumerate(zip(SEQS, caps))]


def test_clean_run_passes(engine, stored):
    rep = check_offsets(engine, "llama", 4, [2], stored, search=2, min_cosine=0.999)
    assert rep.ok and rep.message() == ""
    (r,) = rep.layers
    assert (r.boundary, r.engine_id, r.best_offset) == (2, 2, 0) and r.cosine > 0.9999
    assert sorted(r.cosines) == [-2, -1, 0, 1, 2] and max(r.cosines[d] for d in (-2, -1, 1, 2)) < 0.999
    assert [row["engine"] for row in rep.table()] == [0, 1, 2, 3, 4]
    require_ok(rep)


@pytest.mark.parametrize("planted", [-2, -1, 1, 2])
def test_planted_offset_is_named(engine, stored, monkeypatch, planted):
    """A translator that writes k + planted makes the hf engine feed h[k + planted]: reported as that offset."""
    real = convention.engine_ids

    def buggy(eng, family, boundaries, n, version=None):
        ids = real(eng, family, boundaries, n, version)
        return [i + planted for i in ids]

    monkeypatch.setattr(convention, "engine_ids", buggy)
    rep = check_offsets(engine, "llama", 4, [2], stored, search=2, min_cosine=0.999)
    (r,) = rep.layers
    assert not rep.ok
    assert (r.engine_id, r.best_offset) == (2 + planted, planted) and r.best_cosine > 0.9999
    msg = rep.message()
    assert f"given id {2 + planted} the engine feeds h[{2 + planted}]" in msg
    assert f"off by {planted:+d}" in msg and ("deeper" if planted > 0 else "shallower") in msg
    with pytest.raises(CaptureMismatch, match=re.escape(f"off by {planted:+d}")):
        require_ok(rep)


def test_numerics_gap_is_not_an_offset(engine, stored):
    noisy = [FeatureSample(s.id, s.input_ids, s.loss_mask, s.aux + 0.05 * s.aux.std() * torch.randn_like(s.aux.float()).bfloat16(),
                           s.last) for s in stored]
    rep = check_offsets(engine, "llama", 4, [2], noisy, search=2, min_cosine=0.99999)
    assert not rep.ok and rep.layers[0].best_offset == 0
    assert "a numerics gap, not an offset" in rep.message()
