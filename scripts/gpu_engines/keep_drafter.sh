#!/usr/bin/env bash
# HERE, after a device call brought back NAME.tar.part* and NAME.sha256 (suite.sh draft-keep: NAME drafter, the
# default; suite.sh data-keep: NAME draftdata): make them carry folder .gpu/carry/c08 (drafter) or c09 (draftdata),
# whose MANIFEST.sha256 is the wheels' (c01..c07) plus the kept tar's, so
#   device.sh stash .gpu/carry/c08|c09   (after c01..c06)   and `suite.sh setup` installs it, `suite.sh draft-restore`
# puts the draft back in data/drafter, `suite.sh data-restore` the tokens store in data/features.
# Usage: scripts/gpu_engines/keep_drafter.sh FILES_AT [drafter|draftdata]
set -euo pipefail
src=${1:?FILES_AT: the folder that the files of the keep call came back to}
name=${2:-drafter}
case $name in drafter) cn=c08 ;; draftdata) cn=c09 ;; *) echo "NAME: drafter or draftdata, not $name" >&2; exit 2 ;; esac
cd "$(dirname "$0")/../.."
c=.gpu/carry
[ -f $c/MANIFEST.sha256 ] || { echo "$c/MANIFEST.sha256 missing: build the carry first (scripts/gpu_engines/build.sh)" >&2; exit 1; }
ls "$src"/$name.tar.part* > /dev/null
rm -rf $c/$cn; mkdir -p $c/$cn
cp "$src"/$name.tar.part* $c/$cn/
cat "$src"/$name.tar.part* | sha256sum | sed "s/-\$/$name.tar/" | diff - "$src/$name.sha256" > /dev/null ||
  { echo "the parts in $src do not make the $name.tar of $name.sha256" >&2; exit 1; }
{ grep -v "  $name.tar" $c/MANIFEST.sha256; cat "$src/$name.sha256"; (cd $c/$cn && sha256sum $name.tar.part*); } \
  > $c/$cn/MANIFEST.sha256
echo "carry $c/$cn: $(ls $c/$cn | tr '\n' ' ')($(du -sm $c/$cn | cut -f1) MiB)"
