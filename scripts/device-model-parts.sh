#!/usr/bin/env bash
# A model file too big for one device call (64 MiB a call, tracked files included) goes
# across in parts, one per call of the same warm lease (what a call leaves on the machine
# stays for the next call of the lease).
#
#   scripts/device-model-parts.sh split FILE DIR [BYTES] (here) DIR/01, DIR/02, … each a
#       folder holding one part of at most BYTES (default 61,500,000: with the ~5 MB of
#       tracked files a call stays under 64 MiB), and DIR/sha256 (the whole file's);
#       carry DIR/NN in call NN and DIR/sha256 in the call that joins
#   scripts/device-model-parts.sh take DIR/NN            (device) keeps the part in
#       /tmp/arl-parts for the calls after this one
#   scripts/device-model-parts.sh join SHA256 DEST       (device) DEST from the parts kept,
#       checked against the whole file's SHA-256 (an error names what is missing)
set -euo pipefail
parts=/tmp/arl-parts
case "${1:-}" in
split)
    file=$2 dir=$3 bytes=${4:-61500000}
    rm -rf "$dir" && mkdir -p "$dir"
    split -b "$bytes" -d -a 2 "$file" "$dir/part-"
    i=0
    for part in "$dir"/part-*; do
        i=$((i + 1)); n=$(printf %02d "$i")
        mkdir "$dir/$n" && mv "$part" "$dir/$n/part-$n"
    done
    sha256sum < "$file" | cut -d' ' -f1 > "$dir/sha256"
    echo "$i parts of $file in $dir (sha256 $(cat "$dir/sha256"))"
    ;;
take)
    mkdir -p "$parts"
    cp "$2"/part-* "$parts/"
    echo "kept: $(cd "$parts" && ls | tr '\n' ' ')($(du -sm "$parts" | cut -f1) MB)"
    ;;
join)
    want=$(cat "$2") dest=$3
    [ -d "$parts" ] || { echo "no parts in $parts: run 'take' in earlier calls of this lease" >&2; exit 1; }
    mkdir -p "$(dirname "$dest")"
    cat "$parts"/part-* > "$dest.tmp"
    got=$(sha256sum < "$dest.tmp" | cut -d' ' -f1)
    if [ "$got" != "$want" ]; then
        echo "the joined file's sha256 is $got, not $want: parts kept are $(cd "$parts" && ls | tr '\n' ' ')— a part is missing (the lease ended between calls?) or damaged" >&2
        rm -f "$dest.tmp"; exit 1
    fi
    mv "$dest.tmp" "$dest"
    echo "joined $dest ($(du -m "$dest" | cut -f1) MB, sha256 ok)"
    ;;
*)
    echo "usage: $0 split FILE DIR [BYTES] | take DIR/NN | join SHA256 DEST" >&2; exit 2 ;;
esac
