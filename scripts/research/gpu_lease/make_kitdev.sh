# Builds .kitdev (ignored): the GPU kit's small files without its archive, carried by every call after the first
# (ignored paths carried by one call are gone in the next). Run here, in the repository root, after copying
# ../shared/gpu-sglang into .gpukit as its README says.
set -e
[ -f .gpukit/device/env.sh ] || { echo "no .gpukit/device/env.sh: copy ../shared/gpu-sglang into .gpukit first" >&2; exit 1; }
rm -rf .kitdev && mkdir .kitdev && cp -r .gpukit/device .kitdev/
# the archive stays behind: check that the first call unpacked it instead of checking the archive
sed -i 's/^(cd "$KIT" && sha256sum .*$/[ -f $W\/sgsite\/.done ] || { echo "gpu kit: not unpacked" >\&2; return 4; }/' \
  .kitdev/device/env.sh
grep -q 'sgsite/.done' .kitdev/device/env.sh || { echo "env.sh changed upstream: edit .kitdev/device/env.sh by hand" >&2; exit 2; }
grep -qx '/.kitdev/' .git/info/exclude || echo /.kitdev/ >> .git/info/exclude
echo ".kitdev ready"
