"""Render benchmarks/numerics.py's JSON as a PNG: cosine at offset 0 per stored layer, and τ, per setting.

Usage: python scripts/render_numerics.py NUMERICS_JSON OUT_PNG
Pillow only (it is in the venv; no plotting library is). The same rows are in
the ``*_cosine.csv`` / ``*_tau.csv`` next to the JSON for ``dvc plots show`` (dvc.yaml, top-level plots).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from PIL import Image, ImageDraw

W, H, PAD = 1100, 460, 60
COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]


def setting(row: dict) -> str:
    """One served setting: quantization and the features' origin."""
    return f"{row['quantization'] or 'unquantized'} / features {row['extracted_with']}"


def render(doc: dict, out: Path) -> None:
    rows = doc["rows"]
    settings = list(dict.fromkeys(setting(r) for r in rows))
    layers = sorted({r["layer"] for r in rows})
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    d.text((PAD, 10), f"{doc.get('produced_by', '')}  [{doc.get('device', '?')}]", fill="black")
    # left: cosine per layer (grouped bars), axis from the lowest cosine (rounded down) to 1
    lo = min(r["cosine"] for r in rows)
    lo = min(0.999, float(f"{lo - (1 - lo) * 0.2:.6f}"))
    x0, x1, y0, y1 = PAD, W // 2 + 80, H - PAD, PAD + 30
    d.line([(x0, y0), (x1, y0)], fill="black"), d.line([(x0, y0), (x0, y1)], fill="black")
    d.text((x0, y1 - 18), f"cosine at offset 0 (axis {lo:.6g} .. 1)", fill="black")
    group = (x1 - x0) / max(len(layers), 1)
    bar = group * 0.8 / max(len(settings), 1)
    for li, layer in enumerate(layers):
        d.text((x0 + li * group + group * 0.4, y0 + 6), f"h[{layer}]", fill="black")
        for si, s in enumerate(settings):
            r = next((r for r in rows if r["layer"] == layer and setting(r) == s), None)
            if r is None:
                continue
            top = y0 - (r["cosine"] - lo) / (1 - lo) * (y0 - y1)
            left = x0 + li * group + group * 0.1 + si * bar
            d.rectangle([left, top, left + bar - 2, y0], fill=COLOURS[si % len(COLOURS)])
            d.text((left, top - 12), f"{r['cosine']:.5f}", fill="black")
    # right: τ per setting
    taus = [(s, next((r["tau"] for r in rows if setting(r) == s and r["tau"] is not None), None)) for s in settings]
    x0, x1 = W // 2 + 140, W - PAD
    top_tau = max([t for _, t in taus if t] + [2.0])
    d.line([(x0, y0), (x1, y0)], fill="black"), d.line([(x0, y0), (x0, y1)], fill="black")
    d.text((x0, y1 - 18), f"served tau (k = {doc.get('k', '?')}; 1 = nothing accepted)", fill="black")
    bw = (x1 - x0) / max(len(taus), 1)
    for si, (s, tau) in enumerate(taus):
        left = x0 + si * bw + bw * 0.15
        if tau is None:
            d.text((left, y0 - 14), "not run", fill="black")
            continue
        top = y0 - (tau - 1) / (top_tau - 1) * (y0 - y1)
        d.rectangle([left, top, left + bw * 0.7, y0], fill=COLOURS[si % len(COLOURS)])
        d.text((left, top - 12), f"{tau:.3f}", fill="black")
    for si, s in enumerate(settings):  # legend
        d.rectangle([PAD + si * 340, H - 22, PAD + si * 340 + 10, H - 12], fill=COLOURS[si % len(COLOURS)])
        d.text((PAD + si * 340 + 14, H - 24), s[:52], fill="black")
    img.save(out)


def main() -> None:
    src, out = map(Path, sys.argv[1:3])
    render(json.loads(src.read_text()), out)


if __name__ == "__main__":
    main()
