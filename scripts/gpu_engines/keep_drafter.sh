#!/usr/bin/env bash
# HERE, after a device call `suite.sh keep` brought back drafter.tar.part* and drafter.sha256 (suite.sh draft-keep):
# make them carry folder .gpu/carry/c08, whose MANIFEST.sha256 is the wheels' (c01..c07) plus the drafter's, so
#   device.sh stash .gpu/carry/c08   (after c01..c07)   and `suite.sh setup` installs it, `suite.sh draft-restore`
# puts it back in data/drafter. Usage: scripts/gpu_engines/keep_drafter.sh FILES_AT
set -euo pipefail
src=${1:?FILES_AT: the folder that the files of the keep call came back to}
cd "$(dirname "$0")/../.."
c=.gpu/carry
[ -f $c/MANIFEST.sha256 ] || { echo "$c/MANIFEST.sha256 missing: build the carry first (scripts/gpu_engines/build.sh)" >&2; exit 1; }
ls "$src"/drafter.tar.part* > /dev/null
rm -rf $c/c08; mkdir -p $c/c08
cp "$src"/drafter.tar.part* $c/c08/
cat "$src"/drafter.tar.part* | sha256sum | sed 's/-$/drafter.tar/' | diff - "$src/drafter.sha256" > /dev/null ||
  { echo "the parts in $src do not make the drafter.tar of drafter.sha256" >&2; exit 1; }
{ grep -v '  drafter.tar' $c/MANIFEST.sha256; cat "$src/drafter.sha256"; (cd $c/c08 && sha256sum drafter.tar.part*); } \
  > $c/c08/MANIFEST.sha256
echo "carry $c/c08: $(ls $c/c08 | tr '\n' ' ')($(du -sm $c/c08 | cut -f1) MiB)"
