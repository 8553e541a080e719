# Sourced by the scripts that carry one file to the GPU machine in device calls and join it there (gemma_parts.sh and
# gemma_join.sh, ckpt_parts.sh and ckpt_join.sh).
#
# split_calls FILE DEST CHUNK: FILE's sha256 in DEST/t/NAME.sha256 (NAME: FILE's name without its extension), then
#   FILE split into chunks of at most CHUNK bytes, chunk N alone in DEST/pN/ (one call carries one such folder), their
#   count in DEST/t/nparts; FILE is removed. Prints the count.
# join_calls PART_DIR T OUT_FILE LABEL HINT: the part_* chunks in PART_DIR joined into OUT_FILE, checked against
#   T/NAME.sha256 (NAME: OUT_FILE's name without its extension); the chunks are removed once it matches. Returns 3
#   with one line on stderr (naming LABEL, and HINT for what to bring) where chunks are missing (the machine went back
#   between calls) or the joined file does not match.
split_calls() {
  local file=$1 dest=$2 chunk=$3 n=0 part name
  name=$(basename "$file"); name=${name%.*}
  mkdir -p "$dest/t"
  sha256sum "$file" | cut -d' ' -f1 > "$dest/t/$name.sha256"
  (cd "$(dirname "$file")" && split -b "$chunk" -d -a 2 "$(basename "$file")" part_) && rm -f "$file"
  for part in $(ls "$(dirname "$file")"/part_* | sort); do
    n=$((n + 1)); mkdir -p "$dest/p$n"; mv "$part" "$dest/p$n/"
  done
  echo "$n" > "$dest/t/nparts"
  echo "$n"
}

join_calls() {
  local parts=$1 t=$2 out=$3 label=$4 hint=$5 have want name
  name=$(basename "$out"); name=${name%.*}
  have=$(ls "$parts"/part_* 2>/dev/null | wc -l); want=$(cat "$t/nparts" 2>/dev/null || echo "?")
  if [ "$have" != "$want" ]; then
    echo "$label: $have of $want chunks in $parts: bring $hint (one call each) first" >&2
    return 3
  fi
  cat $(ls "$parts"/part_* | sort) > "$out"
  if [ "$(sha256sum "$out" | cut -d' ' -f1)" != "$(cat "$t/$name.sha256")" ]; then
    echo "$label: the joined chunks do not match $t/$name.sha256: bring them again" >&2
    rm -f "$out"
    return 3
  fi
  rm -f "$parts"/part_*
}
