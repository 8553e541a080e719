#!/usr/bin/env bash
# Here, after the ckpt_out.sh calls: the parts they brought back (each call's folder of files, as arguments) checked
# against their ckpt.manifest and joined, then split into chunks that each fit one device call beside the tracked tree
# (benchmarks/gpu/call_bytes.sh): $DEST/p1..pN (default .dev/ckpt), one chunk a folder, and $DEST/t (the tar's
# sha256, the count, the checkpoint's sha256). On a later GPU machine, one call per folder:
#   mkdir -p /tmp/vx/ckpt && mv .dev/ckpt/pN/part_* /tmp/vx/ckpt/ && ls /tmp/vx/ckpt | wc -l    (carry .dev/ckpt/pN)
# then benchmarks/gpu/ckpt_join.sh (carry .dev/ckpt/t) restores the checkpoint folder.
#   bash benchmarks/gpu/ckpt_parts.sh FOLDER...
# Exit 2 with one line: no manifest, two that differ, a part missing, or parts whose join does not match.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/call_bytes.sh"
. "$here/parts.sh"
DEST=${DEST:-.dev/ckpt}
CHUNK=${CHUNK:-$CHUNK_DEFAULT}
check_chunk CHUNK "$CHUNK"
[ "$#" -ge 1 ] || { echo "ckpt_parts.sh: give the folders the ckpt_out.sh calls brought back" >&2; exit 2; }
manifest=
for folder in "$@"; do
  [ -f "$folder/ckpt.manifest" ] || continue
  if [ -z "$manifest" ]; then manifest=$folder/ckpt.manifest
  elif ! cmp -s "$manifest" "$folder/ckpt.manifest"; then
    echo "ckpt_parts.sh: $folder/ckpt.manifest differs from $manifest: the calls packed two checkpoints" >&2; exit 2
  fi
done
[ -n "$manifest" ] || { echo "ckpt_parts.sh: no ckpt.manifest in $*: not what ckpt_out.sh brought back" >&2; exit 2; }
field() { awk -v key="$1" '$1 == key { print $2 }' "$manifest"; }
parts=$(field nparts)
rm -rf "$DEST/p"[0-9]* "$DEST/t" && mkdir -p "$DEST"
: > "$DEST/ckpt.tar"
missing=()
for n in $(seq 0 $((parts - 1))); do
  name=$(printf 'ckpt.part_%03d' "$n"); found=
  for folder in "$@"; do [ -f "$folder/$name" ] && { found=$folder/$name; break; }; done
  if [ -z "$found" ]; then missing+=("$n"); else cat "$found" >> "$DEST/ckpt.tar"; fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  rm -f "$DEST/ckpt.tar"
  echo "ckpt_parts.sh: parts ${missing[*]} of $parts are missing: bring them (bash benchmarks/gpu/ckpt_out.sh" \
    "${missing[0]} on the machine that holds the checkpoint)" >&2
  exit 2
fi
if [ "$(sha256sum "$DEST/ckpt.tar" | cut -d' ' -f1)" != "$(field tar_sha256)" ]; then
  rm -f "$DEST/ckpt.tar"
  echo "ckpt_parts.sh: the joined parts do not match the manifest's tar_sha256: bring them again" >&2
  exit 2
fi
n=$(split_calls "$DEST/ckpt.tar" "$DEST" "$CHUNK")
field checkpoint_sha256 > "$DEST/t/checkpoint.sha256"
echo "checkpoint $(field checkpoint_sha256 | cut -c1-12): $n calls, carry [\"$DEST/pN\"] for N = 1..$n, then" \
  "ckpt_join.sh with $DEST/t carried"
