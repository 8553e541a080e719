#!/usr/bin/env bash
# On the GPU machine: bring a checkpoint folder back here across device calls, so that later machines start from it
# instead of building it again (issue 45: the GSM8K warm start, about 540 MB, whose rebuild and test scoring took a
# fresh H100 about 6.5 minutes; every seed then starts from one checkpoint, scored on test once).
#
#   bash benchmarks/gpu/ckpt_out.sh FIRST      (FIRST = 0, then what the last call printed, while it says "next")
#
# The first call packs $CKPT (default /tmp/vx/smollm2-gsm8k-sft) into one tar in $STAGE (default /tmp/vx/ckpt_out)
# and splits it into parts of PART_BYTES (default 16000000: a file that comes back may hold 16 MiB); every call copies
# ckpt.manifest (the part count, the tar's sha256, the checkpoint's sha256 as benchmarks.gsm8k_warmstart hash gives
# it) and the parts FIRST .. FIRST+6 into $OUT (eight files come back from a call). Here, ckpt_parts.sh joins what the
# calls brought and makes the carry chunks. Exit 2: no checkpoint in $CKPT, or FIRST past the last part.
set -uo pipefail
CKPT=${CKPT:-/tmp/vx/smollm2-gsm8k-sft}
STAGE=${STAGE:-/tmp/vx/ckpt_out}
PART_BYTES=${PART_BYTES:-16000000}
PER_CALL=7
OUT=${OUT:?ckpt_out.sh: set OUT, the folder whose files come back (the device tool sets it)}
first=${1:-0}
[[ $first =~ ^[0-9]+$ ]] || { echo "ckpt_out.sh: FIRST='$first' is not a part number (0 on the first call)" >&2; exit 2; }
if [ ! -f "$STAGE/ckpt.manifest" ]; then
  if [ ! -f "$CKPT/config.json" ]; then
    echo "ckpt_out.sh: no checkpoint in $CKPT (config.json missing): build it first, or set CKPT" >&2
    exit 2
  fi
  checkpoint=$(python3 -m benchmarks.gsm8k_warmstart hash "$CKPT") || exit 2
  rm -rf "$STAGE" && mkdir -p "$STAGE"
  tar -cf "$STAGE/ckpt.tar" -C "$CKPT" . || exit 2
  tar_sha=$(sha256sum "$STAGE/ckpt.tar" | cut -d' ' -f1)
  (cd "$STAGE" && split -b "$PART_BYTES" -d -a 3 ckpt.tar ckpt.part_ && rm ckpt.tar)
  parts=$(ls "$STAGE"/ckpt.part_* | wc -l)
  printf 'nparts %s\ntar_sha256 %s\ncheckpoint_sha256 %s\n' "$parts" "$tar_sha" "$checkpoint" > "$STAGE/ckpt.manifest"
fi
parts=$(awk '$1 == "nparts" { print $2 }' "$STAGE/ckpt.manifest")
if [ "$first" -ge "$parts" ]; then
  echo "ckpt_out.sh: FIRST=$first is past the last part ($((parts - 1))): every part has been brought" >&2
  exit 2
fi
last=$((first + PER_CALL - 1)); [ "$last" -ge "$parts" ] && last=$((parts - 1))
mkdir -p "$OUT" && cp "$STAGE/ckpt.manifest" "$OUT/"
for n in $(seq "$first" "$last"); do cp "$STAGE/$(printf 'ckpt.part_%03d' "$n")" "$OUT/"; done
if [ "$last" -lt $((parts - 1)) ]; then
  echo "ckpt_out.sh: parts $first-$last of $parts in \$OUT; next: bash benchmarks/gpu/ckpt_out.sh $((last + 1))"
else
  echo "ckpt_out.sh: parts $first-$last of $parts in \$OUT; all parts brought"
fi
