# Sourced by the last bundle call's scripts: install the bundle and set its environment (bundle_install.sh), write
# the SmolLM2 folder (/tmp/vx/smollm2) and a random-init shape of benchmarks/_lib/shapes.py: SHAPE (default
# llama-1.56b-v49k, written to /tmp/vx/l156; another name to /tmp/vx/NAME), its folder in SHAPE_DIR and its
# cost_by_size label (the name without -v49k) in SHAPE_LABEL. Exits the calling script with 3 where the install fails.
. benchmarks/gpu/bundle_install.sh
python3 .dev/vllm/t/mk_smollm2.py 2>&1 | tail -1
SHAPE=${SHAPE:-llama-1.56b-v49k}
if [ "$SHAPE" = llama-1.56b-v49k ]; then SHAPE_DIR=/tmp/vx/l156; else SHAPE_DIR=/tmp/vx/$SHAPE; fi
SHAPE_LABEL=${SHAPE%-v49k}
python3 -m benchmarks.cost_by_size shape "$SHAPE" --tokenizer /tmp/vx/smollm2 --out "$SHAPE_DIR" 2>&1 | tail -1
