#!/usr/bin/env bash
# The one image (the repository's Dockerfile), really built, pushed and started on a machine
# with no Docker daemon and no pullable base image (`make image-check`; `make test` runs it):
#
#   1. a minimal Debian root (debootstrap --variant=minbase, this host's suite and mirror,
#      plus the Dockerfile's RUNTIME_PACKAGES), cached as a tarball in
#      $ARL_CACHE/image/rootfs-<key>.tar.gz, key = hash of suite + packages + make_root;
#   2. committed with buildah as localhost/arl-runtime-base:<key> (kept while the key holds);
#   3. the Dockerfile built with ARTIFACTS=prebuilt: the already-built arl and
#      arl-sandbox-init (stripped copies, from $CARGO_TARGET_DIR) in a temporary context;
#   4. pushed to a docker-registry started on a free port with temporary storage;
#   5. found there by the image builder's registry check (its HEAD request and Accept list);
#   6. its root filesystem mounted (buildah mount) and its entrypoint started in bubblewrap
#      as the image's user, `serve controller` against a nats-server -js started here,
#      until /health answers 200; then stopped with SIGTERM.
#
# Images live in a buildah store of their own ($ARL_CACHE/image/storage), pruned after each
# build. Needs root (as CI runs), buildah, debootstrap, bwrap, docker-registry, nats-server.
#
#   scripts/image-check.sh               the whole check
#   scripts/image-check.sh --build-only  steps 1–3: leave localhost/arl:latest in the store
#
# Environment: ARL_IMAGE_PROFILE (debug|release: which binaries; default the newer),
# ARL_IMAGE_SUITE / ARL_IMAGE_MIRROR (default this host's), ARL_IMAGE_SERVICE (controller),
# ARL_IMAGE_HEALTH_TIMEOUT_S (60).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
ARL_CACHE=${ARL_CACHE:-$HOME/.cache/arl}
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ARL_CACHE/target}
IMAGE_CACHE=$ARL_CACHE/image
STORE=$IMAGE_CACHE/storage
# buildah's run-time state (mounts, locks) for that store: on tmpfs, one per store.
RUNROOT=/run/arl-image-$(printf %s "$STORE" | sha256sum | cut -c1-12)
NATS_SERVER=${ARL_NATS_SERVER:-$ARL_CACHE/tools/bin/nats-server}
REGISTRY_BIN=${ARL_REGISTRY_BIN:-/usr/bin/docker-registry}
SERVICE=${ARL_IMAGE_SERVICE:-controller}
HEALTH_TIMEOUT_S=${ARL_IMAGE_HEALTH_TIMEOUT_S:-60}
IMAGE=localhost/arl:latest
# In the registry: {registry}/{namespace}/{name}:latest, the image builder's naming rule.
REGISTRY_NAMESPACE=arl
REGISTRY_NAME=arl

BUILD_ONLY=false
case "${1:-}" in
    "") ;;
    --build-only) BUILD_ONLY=true ;;
    *) echo "usage: $0 [--build-only]" >&2; exit 2 ;;
esac

say() { printf 'image-check: %s\n' "$*"; }
fail() { printf 'image-check: FAILED: %s\n' "$*" >&2; exit 1; }
# The last lines of a log, indented, on stderr (for a failure's context).
tail_of() { if [ -f "$1" ]; then tail -n "${2:-20}" "$1" | sed 's/^/    /' >&2; fi; }
# buildah on this check's own store: pruning it touches nobody else's images.
bh() { buildah --root "$STORE" --runroot "$RUNROOT" --storage-driver overlay "$@"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Waits until "$@" succeeds, up to $2 seconds; $1 names what is awaited.
wait_until() {
    local what=$1 seconds=$2 started
    shift 2
    started=$(now)
    until "$@" >/dev/null 2>&1; do
        awk -v a="$started" -v b="$(now)" -v s="$seconds" 'BEGIN { exit !(b - a > s) }' \
            && fail "$what did not come up within ${seconds}s"
        sleep 0.2
    done
}

[ "$(id -u)" = 0 ] || fail "run as root (CI does): buildah's store and bubblewrap's bind of the image's root need it"
for tool in buildah debootstrap bwrap curl strip objdump python3 flock; do
    command -v "$tool" >/dev/null || fail "$tool is missing: make image-deps installs it (apt-get install buildah debootstrap bubblewrap curl binutils)"
done
if ! $BUILD_ONLY; then
    [ -x "$REGISTRY_BIN" ] || fail "$REGISTRY_BIN is missing: apt-get install docker-registry (make deps does)"
    [ -x "$NATS_SERVER" ] || fail "$NATS_SERVER is missing: make deps installs it (or set ARL_NATS_SERVER)"
fi

mkdir -p "$IMAGE_CACHE"
# One check at a time per machine: they share the store and the image's tag.
exec 9>"$IMAGE_CACHE/lock"
flock -w 900 9 || fail "another image check held $IMAGE_CACHE/lock for 15 minutes"

WORK=$(mktemp -d "$IMAGE_CACHE/run.XXXXXX")
PIDS=()
CONTAINERS=()
cleanup() {
    local status=$? pid c
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    for c in "${CONTAINERS[@]}"; do
        bh umount "$c" >/dev/null 2>&1 || true
        bh rm "$c" >/dev/null 2>&1 || true
    done
    rm -rf "$WORK"
    exit "$status"
}
trap cleanup EXIT
trap 'printf "image-check: FAILED: line %s: %s\n" "$LINENO" "$BASH_COMMAND" >&2' ERR
trap 'exit 130' INT TERM
STARTED=$(now)

# ---- 1. the Debian root ----------------------------------------------------------------
# The binaries are linked here, so the root is this host's Debian release (its glibc).
if [ -n "${ARL_IMAGE_SUITE:-}" ]; then
    SUITE=$ARL_IMAGE_SUITE
else
    # shellcheck disable=SC1091
    SUITE=$(. /etc/os-release && [ "${ID:-}" = debian ] && echo "${VERSION_CODENAME:-}") || true
    [ -n "$SUITE" ] || fail "not a Debian host: set ARL_IMAGE_SUITE (a Debian suite whose glibc is at least the build host's) and ARL_IMAGE_MIRROR"
fi

# The mirror this host's apt uses for the suite (deb822 .sources, then one-line .list).
apt_mirror() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        awk -v suite="$SUITE" 'BEGIN { RS = "" } {
            types = ""; uri = ""; suites = ""
            n = split($0, lines, "\n")
            for (i = 1; i <= n; i++) {
                if (lines[i] ~ /^Types:/) types = " " substr(lines[i], 7) " "
                if (lines[i] ~ /^URIs:/) { split(substr(lines[i], 6), u, " "); uri = u[1] }
                if (lines[i] ~ /^Suites:/) suites = " " substr(lines[i], 8) " "
            }
            gsub(/[ \t]+/, " ", types); gsub(/[ \t]+/, " ", suites)
            if (types ~ / deb / && suites ~ " " suite " " && uri != "") { print uri; exit }
        }' "$f"
    done
    { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true; } \
        | sed 's/\[[^]]*\]//' \
        | awk -v suite="$SUITE" '$1 == "deb" && $3 == suite { print $2 }'
}
MIRROR=${ARL_IMAGE_MIRROR:-$(apt_mirror)}
MIRROR=${MIRROR%%$'\n'*}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

# What the runtime needs, from the Dockerfile (one list for both ways of building).
PACKAGES=$(sed -n 's/^ARG RUNTIME_PACKAGES="\(.*\)"$/\1/p' "$REPO/Dockerfile")
[ -n "$PACKAGES" ] || fail "no ARG RUNTIME_PACKAGES=\"…\" line in $REPO/Dockerfile"

# Makes the root in $1. Its text is part of the cache key: changing it makes a new root.
make_root() {
    local dir=${1:?}
    debootstrap --variant=minbase --components=main --include="${PACKAGES// /,}" \
        "$SUITE" "$dir" "$MIRROR" >"$dir.log" 2>&1 \
        || { tail_of "$dir.log" 30; return 1; }
    # A container gets /dev, resolv.conf and hostname from its runtime; it needs no package
    # downloads or lists, manuals, translations or logs (copyright files are kept).
    (cd "$dir" && rm -rf dev/* etc/resolv.conf etc/hostname var/cache/apt/archives/*.deb \
        var/cache/apt/*.bin var/lib/apt/lists/* usr/share/man/* usr/share/info/* \
        usr/share/locale/* var/log/*)
    find "$dir/usr/share/doc" -type f ! -name copyright -delete
    # The root's glibc, beside the tarball: the binaries must not need a newer one.
    sed -n '/^Package: libc6$/,/^$/s/^Version: \([0-9.]*\).*/\1/p' "$dir/var/lib/dpkg/status"
}
KEY=$( { echo "$SUITE"; echo "$PACKAGES"; declare -f make_root; } | sha256sum | cut -c1-16)
ROOTFS=$IMAGE_CACHE/rootfs-$KEY.tar.gz
BASE_IMAGE=localhost/arl-runtime-base:$KEY

t=$(now)
ROOT_CACHED=true
if [ ! -s "$ROOTFS" ] || [ ! -s "$ROOTFS.glibc" ]; then
    ROOT_CACHED=false
    say "debootstrap $SUITE ($PACKAGES) from $MIRROR — once per key $KEY"
    root=$WORK/rootfs
    make_root "$root" >"$WORK/glibc" || fail "debootstrap $SUITE from $MIRROR failed (log above)"
    tar --numeric-owner -C "$root" -cf - . | gzip -1 >"$WORK/rootfs.tar.gz"
    mv "$WORK/rootfs.tar.gz" "$ROOTFS"
    mv "$WORK/glibc" "$ROOTFS.glibc"
    rm -rf "$root"
    # Older keys' roots are this script's own leftovers.
    find "$IMAGE_CACHE" -maxdepth 1 -name 'rootfs-*.tar.gz*' ! -name "rootfs-$KEY.*" -delete
fi
ROOT_GLIBC=$(cat "$ROOTFS.glibc")
[ -n "$ROOT_GLIBC" ] || fail "$ROOTFS.glibc is empty: delete $ROOTFS and run again"
ROOT_SECONDS=$(since "$t")

# ---- 2. the runtime base image -----------------------------------------------------------
t=$(now)
BASE_CACHED=true
if ! bh inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    BASE_CACHED=false
    say "committing $BASE_IMAGE from $(basename "$ROOTFS")"
    c=$(bh from scratch)
    CONTAINERS+=("$c")
    bh add "$c" "$ROOTFS" / >/dev/null
    bh config --os linux --arch amd64 --cmd /bin/sh \
        --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --label "org.opencontainers.image.description=debootstrap --variant=minbase $SUITE + $PACKAGES" \
        --label "arl.glibc=$ROOT_GLIBC" "$c"
    bh commit -q --rm "$c" "$BASE_IMAGE" >/dev/null
    CONTAINERS=()
    for old in $(bh images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/arl-runtime-base:' | grep -v ":$KEY\$" || true); do
        bh rmi "$old" >/dev/null 2>&1 || true
    done
fi
BASE_SECONDS=$(since "$t")

# ---- 3. the image, from prebuilt binaries ------------------------------------------------
t=$(now)
profile_dir() { echo "$CARGO_TARGET_DIR/$1"; }
has_binaries() { [ -x "$(profile_dir "$1")/arl" ] && [ -x "$(profile_dir "$1")/arl-sandbox-init" ]; }
if [ -n "${ARL_IMAGE_PROFILE:-}" ]; then
    PROFILE=$ARL_IMAGE_PROFILE
elif has_binaries debug && has_binaries release; then
    PROFILE=$( [ "$(profile_dir release)/arl" -nt "$(profile_dir debug)/arl" ] && echo release || echo debug)
elif has_binaries release; then
    PROFILE=release
else
    PROFILE=debug
fi
if ! has_binaries "$PROFILE"; then
    say "building arl and arl-sandbox-init ($PROFILE)"
    flags=(--locked)
    if [ "$PROFILE" = release ]; then flags+=(--release); fi
    (cd "$REPO" && CARGO_TARGET_DIR=$CARGO_TARGET_DIR cargo build "${flags[@]}" \
        -p arl-cli --bin arl -p arl-sandbox --bin arl-sandbox-init) \
        || fail "cargo build of arl and arl-sandbox-init failed"
fi
BIN_DIR=$(profile_dir "$PROFILE")
CONTEXT=$WORK/context
mkdir -p "$CONTEXT/bin"
strip -o "$CONTEXT/bin/arl" "$BIN_DIR/arl"
strip -o "$CONTEXT/bin/arl-sandbox-init" "$BIN_DIR/arl-sandbox-init"

# The newest glibc symbol version the binaries link against, against the root's glibc.
NEEDED_GLIBC=$(objdump -T "$CONTEXT/bin/arl" "$CONTEXT/bin/arl-sandbox-init" \
    | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -n1)
[ "$(printf '%s\n%s\n' "$NEEDED_GLIBC" "$ROOT_GLIBC" | sort -V | tail -n1)" = "$ROOT_GLIBC" ] \
    || fail "the binaries need glibc $NEEDED_GLIBC but the $SUITE root has $ROOT_GLIBC: build them on (or for) a release no newer than $SUITE, or set ARL_IMAGE_SUITE"

say "building $IMAGE ($PROFILE binaries on $BASE_IMAGE)"
bh bud --isolation chroot --pull=never -f "$REPO/Dockerfile" \
    --build-arg ARTIFACTS=prebuilt \
    --build-arg "RUNTIME_BASE=$BASE_IMAGE" \
    --build-arg INSTALL_RUNTIME_PACKAGES=false \
    -t "$IMAGE" "$CONTEXT" >"$WORK/build.log" 2>&1 \
    || { tail_of "$WORK/build.log" 30; fail "buildah bud of $REPO/Dockerfile failed (log above)"; }
# The previous build's image and the prebuilt stage's are now untagged, and the artifacts
# stage leaves its working container behind: drop them (this store is ours, and locked).
bh rm --all >/dev/null 2>&1 || true
bh rmi --prune >/dev/null 2>&1 || true
BUILD_SECONDS=$(since "$t")
IMAGE_ID=$(bh inspect --type image --format '{{.FromImageID}}' "$IMAGE" | cut -c1-12)
IMAGE_SIZE=$(bh images --format '{{.Size}}' "$IMAGE" | head -n1)
ARL_SIZE=$(du -h "$CONTEXT/bin/arl" | cut -f1)
INIT_SIZE=$(du -h "$CONTEXT/bin/arl-sandbox-init" | cut -f1)
root_note=$($ROOT_CACHED && echo cached || echo debootstrapped)
base_note=$($BASE_CACHED && echo cached || echo committed)

if $BUILD_ONLY; then
    say "ok: $IMAGE (id $IMAGE_ID, $IMAGE_SIZE) in the store $STORE"
    say "  push it: buildah --root $STORE --runroot $RUNROOT push $IMAGE docker://REGISTRY/arl/arl:TAG"
    exit 0
fi

# ---- 4. a registry, and the push ---------------------------------------------------------
t=$(now)
REGISTRY_PORT=$(free_port)
REGISTRY=127.0.0.1:$REGISTRY_PORT
cat >"$WORK/registry.yml" <<EOF
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $WORK/registry
http:
  addr: $REGISTRY
EOF
"$REGISTRY_BIN" serve "$WORK/registry.yml" >"$WORK/registry.log" 2>&1 &
PIDS+=($!)
wait_until "docker-registry on $REGISTRY" 20 curl -fsS "http://$REGISTRY/v2/"
REFERENCE=$REGISTRY/$REGISTRY_NAMESPACE/$REGISTRY_NAME:latest
bh push --tls-verify=false --digestfile "$WORK/digest" "$IMAGE" "docker://$REFERENCE" >"$WORK/push.log" 2>&1 \
    || { tail_of "$WORK/push.log"; tail_of "$WORK/registry.log"; fail "buildah push to $REFERENCE failed (log above)"; }
PUSHED_DIGEST=$(cat "$WORK/digest")
PUSH_SECONDS=$(since "$t")

# ---- 5. the image builder's registry check -----------------------------------------------
# `arl image check` runs the image builder's own client (Registry::manifest_digest): HEAD
# {namespace}/{instance}:latest with its Accept list, the digest from Docker-Content-Digest.
FOUND=$("$BIN_DIR/arl" image check --registry "http://$REGISTRY" --namespace "$REGISTRY_NAMESPACE" "$REGISTRY_NAME" 2>"$WORK/check.err") \
    || { cat "$WORK/check.err" >&2; fail "arl image check did not find $REFERENCE"; }
FOUND_DIGEST=${FOUND##*@}
[ "$FOUND_DIGEST" = "$PUSHED_DIGEST" ] \
    || fail "the registry has $REFERENCE as ${FOUND_DIGEST:-no digest}, buildah pushed $PUSHED_DIGEST"
# …and tells a missing image (exit 4) from a found one.
missing=0
"$BIN_DIR/arl" image check --registry "http://$REGISTRY" --namespace "$REGISTRY_NAMESPACE" no-such-image >/dev/null 2>&1 \
    || missing=$?
[ "$missing" = 4 ] || fail "arl image check exited $missing for an image never pushed (expected 4)"
ACCEPT=$(sed -n 's/^const ACCEPT: &str = "\(.*\)";$/\1/p' "$REPO/services/imagebuilder/src/registry.rs")
MANIFEST_URL=http://$REGISTRY/v2/$REGISTRY_NAMESPACE/$REGISTRY_NAME/manifests/latest
curl -sS -o /dev/null -D "$WORK/head" -I -H "accept: $ACCEPT" "$MANIFEST_URL"
MEDIA_TYPE=$(tr -d '\r' <"$WORK/head" | awk 'tolower($1) == "content-type:" { print $2 }')
PUSHED_BYTES=$(curl -fsS -H "accept: $ACCEPT" "$MANIFEST_URL" \
    | python3 -c 'import json, sys; m = json.load(sys.stdin); print(sum(l["size"] for l in m["layers"]))')

# ---- 6. the image, started ---------------------------------------------------------------
t=$(now)
NATS_PORT=$(free_port)
NATS_MONITOR_PORT=$(free_port)
"$NATS_SERVER" -js -a 127.0.0.1 -p "$NATS_PORT" -m "$NATS_MONITOR_PORT" -sd "$WORK/nats" \
    >"$WORK/nats.log" 2>&1 &
PIDS+=($!)
wait_until "nats-server -js on 127.0.0.1:$NATS_PORT" 20 curl -fsS "http://127.0.0.1:$NATS_MONITOR_PORT/healthz"

c=$(bh from --pull=never "$IMAGE")
CONTAINERS+=("$c")
ROOT=$(bh mount "$c")
config() { bh inspect --type image --format "$1" "$IMAGE"; }
USER_SPEC=$(config '{{.OCIv1.Config.User}}')
RUN_UID=${USER_SPEC%%:*}
RUN_GID=$([[ $USER_SPEC == *:* ]] && echo "${USER_SPEC#*:}" || echo "$RUN_UID")
[[ $RUN_UID =~ ^[0-9]+$ && $RUN_GID =~ ^[0-9]+$ && $RUN_UID != 0 ]] \
    || fail "the image's USER is '$USER_SPEC': it should be a numeric non-root uid[:gid]"
WORKDIR=$(config '{{.OCIv1.Config.WorkingDir}}')
mapfile -t ENTRYPOINT < <(config '{{range .OCIv1.Config.Entrypoint}}{{println .}}{{end}}' | sed '/^$/d')
mapfile -t IMAGE_ENV < <(config '{{range .OCIv1.Config.Env}}{{println .}}{{end}}' | sed '/^$/d')
mapfile -t DEFAULT_CMD < <(config '{{range .OCIv1.Config.Cmd}}{{println .}}{{end}}' | sed '/^$/d')
[ "${#ENTRYPOINT[@]}" -gt 0 ] || fail "the image has no ENTRYPOINT"

HTTP_PORT=$(free_port)
# A container's view: the image's root read-write, its own /dev, /proc and /tmp, pid, ipc
# and uts namespaces, the image's environment and working directory, the host's network
# (NATS and the ops port are on 127.0.0.1). bwrap runs as root to bind a root only root can
# read; setpriv (util-linux, in the image) then drops to the image's USER, as a runtime does.
bwrap_args=(--bind "$ROOT" / --dev /dev --proc /proc --tmpfs /tmp
    --unshare-pid --unshare-ipc --unshare-uts --die-with-parent --clearenv)
for kv in "${IMAGE_ENV[@]}"; do bwrap_args+=(--setenv "${kv%%=*}" "${kv#*=}"); done
bwrap_args+=(--setenv NATS_URL "nats://127.0.0.1:$NATS_PORT" --setenv ARL_HTTP_ADDR "127.0.0.1:$HTTP_PORT"
    --chdir "${WORKDIR:-/}" -- /usr/bin/setpriv --reuid "$RUN_UID" --regid "$RUN_GID" --clear-groups
    --inh-caps=-all --bounding-set=-all --no-new-privs --)

# The default command first: it must run and exit 0 (it prints the usage of `arl serve`).
bwrap "${bwrap_args[@]}" "${ENTRYPOINT[@]}" "${DEFAULT_CMD[@]}" >"$WORK/default-cmd.log" 2>&1 \
    || { tail_of "$WORK/default-cmd.log"; fail "the image's default command (${ENTRYPOINT[*]} ${DEFAULT_CMD[*]}) failed"; }

bwrap "${bwrap_args[@]}" "${ENTRYPOINT[@]}" serve "$SERVICE" >"$WORK/service.log" 2>&1 &
BWRAP_PID=$!
PIDS+=("$BWRAP_PID")
run_started=$(now)
HEALTH_URL=http://127.0.0.1:$HTTP_PORT/health
until [ "$(curl -sS -o "$WORK/health" -w '%{http_code}' --max-time 2 "$HEALTH_URL" 2>/dev/null)" = 200 ]; do
    kill -0 "$BWRAP_PID" 2>/dev/null \
        || { tail_of "$WORK/service.log"; fail "arl serve $SERVICE exited before /health answered (log above)"; }
    awk -v a="$run_started" -v b="$(now)" -v s="$HEALTH_TIMEOUT_S" 'BEGIN { exit !(b - a > s) }' \
        && { tail_of "$WORK/service.log"; fail "$HEALTH_URL did not answer 200 within ${HEALTH_TIMEOUT_S}s (log above)"; }
    sleep 0.2
done
HEALTH_SECONDS=$(since "$run_started")
HEALTH_BODY=$(head -c 200 "$WORK/health")
READY_STATUS=$(curl -sS -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$HTTP_PORT/ready" || true)

# The service's process: the one named arl under bwrap; its real uid, as the kernel has it.
descendants() {
    local child
    for child in $(ps -o pid= --ppid "$1"); do echo "$child"; descendants "$child"; done
}
ARL_PID=$(for p in $(descendants "$BWRAP_PID"); do [ "$(cat "/proc/$p/comm" 2>/dev/null)" = arl ] && echo "$p"; done | head -n1)
[ -n "$ARL_PID" ] || fail "no arl process under bubblewrap ($BWRAP_PID)"
RUNNING_UID=$(awk '/^Uid:/ { print $2 }' "/proc/$ARL_PID/status")
[ "$RUNNING_UID" = "$RUN_UID" ] || fail "arl runs as uid $RUNNING_UID, the image says $RUN_UID"

# Stopped as a runtime stops a container: SIGTERM, then it must drain and exit 0.
stop_started=$(now)
kill -TERM "$ARL_PID"
exit_status=0
for _ in $(seq 1 300); do kill -0 "$BWRAP_PID" 2>/dev/null || break; sleep 0.1; done
kill -0 "$BWRAP_PID" 2>/dev/null && { tail_of "$WORK/service.log"; fail "arl serve $SERVICE was still running 30 s after SIGTERM"; }
wait "$BWRAP_PID" || exit_status=$?
STOP_SECONDS=$(since "$stop_started")
[ "$exit_status" = 0 ] || { tail_of "$WORK/service.log"; fail "arl serve $SERVICE exited $exit_status on SIGTERM (log above)"; }
RUN_SECONDS=$(since "$t")

human() { numfmt --to=iec --suffix=B "$1" 2>/dev/null || echo "$1 bytes"; }
say "ok"
cat <<EOF
  image     $IMAGE  id $IMAGE_ID  $IMAGE_SIZE  (arl $ARL_SIZE, arl-sandbox-init $INIT_SIZE: $PROFILE, stripped)
  base      $BASE_IMAGE  debootstrap minbase $SUITE, glibc $ROOT_GLIBC (binaries need $NEEDED_GLIBC)
  registry  $REFERENCE  $FOUND_DIGEST  ($MEDIA_TYPE, layers $(human "$PUSHED_BYTES") compressed; found by arl image check)
  run       ${ENTRYPOINT[*]} serve $SERVICE as uid $RUNNING_UID in bubblewrap: /health 200 $HEALTH_BODY after ${HEALTH_SECONDS}s, /ready $READY_STATUS; SIGTERM → exit 0 in ${STOP_SECONDS}s
  seconds   root ${ROOT_SECONDS} ($root_note) · base ${BASE_SECONDS} ($base_note) · build ${BUILD_SECONDS} · push ${PUSH_SECONDS} · run ${RUN_SECONDS} · total $(since "$STARTED")
EOF
