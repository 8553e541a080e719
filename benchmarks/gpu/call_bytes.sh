# Sourced by the scripts that split a bundle into device calls (vllm031_bundle.sh, gemma_parts.sh), from the project
# root: CALL_BYTES, what one call may carry here (below the device README's 64 MiB, by what calls carried:
# benchmarks/results/h100/README.md, "The GSM8K comparison's first attempt"); TREE_BYTES, the tracked tree every call carries (0 outside a git checkout); and
# CHUNK_DEFAULT, the largest chunk that fits one call beside the tree with 5 MB left for the call's other carries
# (a bundle's t/, data), in whole 100 kB.
CALL_BYTES=63000000
TREE_BYTES=$(git ls-files -z 2>/dev/null | xargs -0 -r stat -c %s 2>/dev/null | awk '{ total += $1 } END { print total + 0 }') \
  || TREE_BYTES=0  # no git checkout: under set -e -o pipefail the failed pipeline must not end the caller
CHUNK_DEFAULT=$(( (CALL_BYTES - TREE_BYTES - 5000000) / 100000 * 100000 ))
# check_chunk NAME VALUE: exits 2 with one line where VALUE is no whole number of bytes in 1000000..62000000 or
# cannot fit one call beside the tree.
check_chunk() {
  local name=$1 value=$2
  if ! [[ $value =~ ^[1-9][0-9]*$ ]]; then
    echo "$name='$value' is not a positive whole number of bytes; leave it unset for the largest that fits" >&2; exit 2
  fi
  if [ "${#value}" -gt 9 ] || [ "$value" -lt 1000000 ] || [ "$value" -gt 62000000 ]; then
    echo "$name=$value is outside 1000000..62000000 bytes (one call carries 64 MiB: the chunk plus the project tree)" >&2
    exit 2
  fi
  if [ $((value + TREE_BYTES)) -gt "$CALL_BYTES" ]; then
    echo "$name=$value does not fit one call beside the tracked tree ($TREE_BYTES bytes): a call carries at most" \
      "$CALL_BYTES here; leave it unset for the largest that fits with room for the call's other carries" >&2
    exit 2
  fi
}
