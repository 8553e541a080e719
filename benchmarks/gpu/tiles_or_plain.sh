# Sourced by the scripts that measure a tile table before cost runs (tiles_first.sh, cost_by_size_session.sh).
# tiles_or_plain TABLE ARMS_VAR: where TABLE exists, copies it into $OUT and sets tiles=(--matmul-tiles TABLE); else
# says so, empties tiles and turns each ARM:tiles in the variable named ARMS_VAR into ARM, and ARM:tiles+SCOPE into
# ARM:SCOPE (duplicates dropped), so the runs go on without the table.
tiles_or_plain() {
  local table=$1
  local -n arms_ref=$2
  if [ -f "$table" ]; then
    cp "$table" "$OUT/"
    tiles=(--matmul-tiles "$table")
    return
  fi
  echo "no tile table: the runs below are arms without it"
  tiles=()
  arms_ref=$(printf '%s\n' ${arms_ref//,/ } | sed 's/:tiles$//; s/:tiles+/:/; s/+tiles\(+\|$\)/\1/' | awk '!seen[$0]++' | paste -sd,)
}
