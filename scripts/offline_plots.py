"""Make `dvc plots show` render without network: inline vega, vega-lite and vega-embed into a local template.

Usage: python scripts/offline_plots.py        (run by scripts/setup.sh; idempotent)
DVC's default page loads these three scripts from a CDN, so offline (clusters, the GPU box, this project's
machines) the page is blank. This fetches the same versions through npm (`npm pack`, from the npm registry)
into .cache/vega/ and writes bundled/dvc_plots.html, the `plots.html_template` named in .dvc/config. Without
npm it writes a template that loads them from the CDN, as DVC itself does.
"""

import shutil
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The versions dvc-render's own page uses (dvc_render/vega.py).
PACKAGES = {"vega": "5.20.2", "vega-lite": "5.2.0", "vega-embed": "6.18.2"}
CDN = "https://cdn.jsdelivr.net/npm"
PAGE = """<!DOCTYPE html>
<html>
<head>
    {{refresh_tag}}
    <title>eaglepipe plots</title>
    {scripts}
    <style>body {{ font-family: sans-serif; }} table {{ border-spacing: 15px; }}</style>
</head>
<body>
    {{plot_divs}}
</body>
</html>
"""


def script_of(name: str, version: str, cache: Path) -> str | None:
    """The package's build/<name>.min.js as an inline <script>, via `npm pack` (None without npm)."""
    tgz = cache / f"{name}-{version}.tgz"
    if not tgz.exists():
        if shutil.which("npm") is None:
            return None
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "pack", "--silent", f"{name}@{version}"], cwd=cache, check=True,
                       stdout=subprocess.DEVNULL)
    with tarfile.open(tgz) as tar:
        js = tar.extractfile(f"package/build/{name}.min.js").read().decode()
    js = js.replace("</script", "<\\/script")
    return f"<script>\n{js}\n</script>"


def main():
    cache = REPO / ".cache" / "vega"
    scripts = [script_of(n, v, cache) for n, v in PACKAGES.items()]
    if None in scripts:
        print("offline_plots: npm not found; the plots page will load vega from the CDN")
        scripts = [f'<script src="{CDN}/{n}@{v}"></script>' for n, v in PACKAGES.items()]
    out = REPO / "bundled" / "dvc_plots.html"
    out.parent.mkdir(exist_ok=True)
    # literal braces in the JS must survive dvc-render's placeholder replacement: it replaces only
    # {plot_divs}, {scripts} and {refresh_tag}, by str.replace, so no escaping is needed beyond our own format.
    out.write_text(PAGE.format(scripts="\n".join(scripts)))
    print(f"offline_plots: wrote {out.relative_to(REPO)} ({out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
