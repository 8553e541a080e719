#!/usr/bin/env bash
set -u
t0=$(date +%s)
. benchmarks/gpu/bundle_and_shape.sh
bash benchmarks/gpu/onpolicy_grad_test.sh "$SHAPE_DIR"
echo "call total $(( $(date +%s) - t0 )) s"
