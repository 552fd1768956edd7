#!/usr/bin/env bash
# ON THE DEVICE (the H200), from the repo root. Parts survive in /tmp/eng while the machine stays warm (~30 s).
#   device.sh stash .gpu/carry/NN     copy this call's part(s) to /tmp/eng and check their sha256
#   device.sh install vllm|sglang|inputs|data|drafter|draftdata   concatenate the stage's parts, check the whole
#                                     sha256, install
#                                     (inputs: unpacked to /tmp/eng/inputs for lab/h200_engines.py)
#   source <(device.sh env vllm|sglang)   PYTHONPATH + engine env for the checks
set -euo pipefail
E=${DEVICE_ENG:-/tmp/eng}
case ${1:-} in
  stash)
    # the manifests merge, a file's latest line winning: a kept draft (c08) and kept data (c09) stash together
    mkdir -p $E; cp "$2"/*.part* $E/
    { cat $E/MANIFEST.sha256 2>/dev/null || true; cat "$2"/MANIFEST.sha256; } |
      awk '{m[$2] = $0} END {for (f in m) print m[f]}' > $E/MANIFEST.new
    mv $E/MANIFEST.new $E/MANIFEST.sha256
    (cd $E && for p in $(cd "$OLDPWD/$2" && ls *.part*); do grep "  $p\$" MANIFEST.sha256; done | sha256sum -c -)
    ls -l $E ;;
  install)
    s=$2; site=/tmp/site; [ "$s" = sglang ] && site=/tmp/site-sgl
    a=$s.tar   # files, not wheels, are unpacked only; kept sets are xz'd (suite.sh keep_set)
    case $s in inputs|data) site=$E/$s ;; drafter|draftdata) site=$E/$s a=$s.tar.xz ;; esac
    ls $E/$a.part* >/dev/null   # fails loudly when the machine went cold and /tmp/eng was lost
    cat $E/$a.part* > $E/$a
    (cd $E && grep "  $a\$" MANIFEST.sha256 | sha256sum -c -)
    rm -f $E/$a.part*
    rm -rf $E/$s; mkdir -p $E/$s $site; tar -xf $E/$a -C $E/$s; rm -f $E/$a
    [ "$site" = $E/$s ] && { echo "$s in $site: $(ls $site)"; exit 0; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site $E/$s/wheels/*.whl
    for t in $E/$s/*-tree.tar.xz; do tar -xJf "$t" -C $site; done   # pruned wheel trees = site-packages layout
    echo "installed stage $s into $site: $(du -sm $site | cut -f1) MiB" ;;
  env)
    # SGLang also gets shims/ (an IPython stand-in and exist_ok config registration, see shims/sitecustomize.py)
    if [ "${2:-vllm}" = sglang ]; then echo "export PYTHONPATH=/tmp/site-sgl:/tmp/site:$(cd "$(dirname "$0")" && pwd)/shims"
    else echo "export PYTHONPATH=/tmp/site"; fi
    echo "export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1"
    echo "export VLLM_CACHE_ROOT=/tmp/vllm-cache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor FLASHINFER_WORKSPACE_BASE=/tmp/fi" ;;
  *) sed -n 2,6p "$0"; exit 2 ;;
esac
