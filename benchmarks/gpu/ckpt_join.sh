#!/usr/bin/env bash
# On the GPU machine, after the chunk calls of ckpt_parts.sh's folders (each: mkdir -p /tmp/vx/ckpt && mv
# .dev/ckpt/pN/part_* /tmp/vx/ckpt/): the checkpoint restored into $CKPT (default /tmp/vx/smollm2-gsm8k-sft), the
# joined tar checked against $T/ckpt.sha256 (default .dev/ckpt/t, carried with this call) and the folder against the
# checkpoint's sha256 ($T/checkpoint.sha256, benchmarks.gsm8k_warmstart hash). Exit 0 with the checkpoint in place
# (also when $CKPT already held it); 3 where chunks are missing (the machine went back between calls: bring them
# again) or do not match, or where $CKPT holds another checkpoint.
set -uo pipefail
CKPT=${CKPT:-/tmp/vx/smollm2-gsm8k-sft}
CKPT_DIR=${CKPT_DIR:-/tmp/vx/ckpt}
T=${T:-.dev/ckpt/t}
want=$(cat "$T/checkpoint.sha256" 2>/dev/null) || { echo "ckpt_join.sh: no $T/checkpoint.sha256: carry $T" >&2; exit 3; }
if [ -f "$CKPT/config.json" ]; then
  have=$(python3 -m benchmarks.gsm8k_warmstart hash "$CKPT")
  if [ "$have" = "$want" ]; then echo "ckpt_join.sh: $CKPT already holds checkpoint ${want:0:12}"; exit 0; fi
  echo "ckpt_join.sh: $CKPT holds another checkpoint (${have:0:12}, not ${want:0:12}): remove it or set CKPT" >&2
  exit 3
fi
. "$(dirname "$0")/parts.sh"
join_calls "$CKPT_DIR" "$T" "$CKPT_DIR/ckpt.tar" ckpt_join.sh ".dev/ckpt/p1..p$(cat "$T/nparts" 2>/dev/null)" || exit 3
mkdir -p "$CKPT" && tar -xf "$CKPT_DIR/ckpt.tar" -C "$CKPT" && rm -f "$CKPT_DIR/ckpt.tar"
have=$(python3 -m benchmarks.gsm8k_warmstart hash "$CKPT")
if [ "$have" != "$want" ]; then
  echo "ckpt_join.sh: the restored $CKPT hashes to ${have:0:12}, not ${want:0:12}: bring the chunks again" >&2
  rm -rf "$CKPT"
  exit 3
fi
echo "ckpt_join.sh: checkpoint ${want:0:12} in $CKPT"
