#!/usr/bin/env bash
# Build .ktcarry/: kt-kernel 0.7.2's Python package and shared objects (no torch, which its
# extension does not link) plus gguf (imported by kt's loader), for a host without network whose
# own torch runs them: PYTHONPATH=.ktcarry python3 benchmarks/kt_check.py (benchmarks/README.md).
# Run on a machine that reaches PyPI; PYVER is the target host's Python (its wheels are per
# CPython version: cp311, cp312). About 43 MB (kt_kernel 41 MB: six CPU variants), under the
# device's 64 MiB carry; VARIANT=amx keeps one CPU build (about 12 MB).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PYVER=${PYVER:-3.12}
DEST=${DEST:-.ktcarry}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --platform manylinux_2_35_x86_64 kt-kernel==0.7.2 gguf -d "$tmp"
rm -rf "$DEST" && mkdir -p "$DEST"
for whl in "$tmp"/*.whl; do
  python3 -m zipfile -e "$whl" "$tmp/x"
done
cp -r "$tmp/x/kt_kernel" "$tmp/x/kt_kernel.libs" "$tmp/x/gguf" "$DEST/"
rm -rf "$DEST/kt_kernel/cli" "$DEST/kt_kernel/sft"  # not imported by the MoE path
if [ -n "${VARIANT:-}" ]; then  # e.g. VARIANT=amx: one CPU build (9 MB), for a tree near the 64 MiB carry
  find "$DEST/kt_kernel" -maxdepth 1 -name '_kt_kernel_ext_*.so' ! -name "_kt_kernel_ext_${VARIANT}.*" -delete
fi
du -sh "$DEST"
