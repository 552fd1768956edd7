#!/usr/bin/env bash
# HERE, after device calls brought back NAME.tar.xz.part* and NAME.sha256 (suite.sh draft-keep: NAME drafter;
# suite.sh data-keep: NAME draftdata), perhaps over several `watch` calls (each returns ≤ 3 parts: the device
# sends back ≤ 8 files, 64 MiB): make them carry folders of ≤ 4 parts each (a call carries ≤ 64 MiB, the
# working tree included): .gpu/carry/c08, c08b, ... (drafter) or c09, c09b, ... (draftdata). Each folder's
# MANIFEST.sha256 is the wheels' (c01..c07) plus the kept tar's and its own parts', so
#   device.sh stash .gpu/carry/c09 ; ... c09b   (after c01..c06)   and `suite.sh setup` installs the set,
# `suite.sh draft-restore` puts the draft back in data/drafter, `suite.sh data-restore` the tokens store in data/.
# Usage: lab/gpu_engines/keep_drafter.sh drafter|draftdata FILES_AT...
set -euo pipefail
name=${1:-}
case $name in drafter) cn=c08 ;; draftdata) cn=c09 ;; *) echo "NAME: drafter or draftdata, not '$name'" >&2; exit 2 ;; esac
shift; [ $# -ge 1 ] || { echo "FILES_AT: the folder(s) the kept parts came back to" >&2; exit 2; }
cd "$(dirname "$0")/../.."
c=.gpu/carry
[ -f $c/MANIFEST.sha256 ] || { echo "$c/MANIFEST.sha256 missing: build the carry first (lab/gpu_engines/build.sh)" >&2; exit 1; }
got=$(mktemp -d); trap 'rm -rf "$got"' EXIT
for src in "$@"; do cp "$src"/$name.* "$got"/ 2>/dev/null || true; done
a=$name.tar.xz  # suite.sh keep_set's archive
ls "$got"/$a.part* > /dev/null 2>&1 && [ -f "$got/$name.sha256" ] ||
  { echo "no $a.part* with $name.sha256 in $*" >&2; exit 1; }
cat "$got"/$a.part* | sha256sum | sed "s/-\$/$a/" | diff - "$got/$name.sha256" > /dev/null ||
  { echo "the parts in $* do not make the $a of $name.sha256 (one missing or changed)" >&2; exit 1; }
rm -rf $c/$cn $c/${cn}[b-h]
parts=("$got"/$a.part*); suffix=("" b c d e f g h)
[ ${#parts[@]} -le 32 ] || { echo "${#parts[@]} parts: more than 8 carry folders (32 parts) hold" >&2; exit 1; }
for ((i = 0; i < ${#parts[@]}; i += 4)); do
  f=$c/$cn${suffix[i / 4]}; mkdir -p "$f"; cp "${parts[@]:i:4}" "$f"/
  { grep -v "  $name.tar" $c/MANIFEST.sha256; cat "$got/$name.sha256"; (cd "$f" && sha256sum $a.part*); } \
    > "$f"/MANIFEST.sha256
  echo "carry $f: $(ls "$f" | tr '\n' ' ')($(du -sm "$f" | cut -f1) MiB)"
done
