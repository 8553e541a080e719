#!/usr/bin/env bash
# A folder holding vLLM 0.31.0 and the compiled pieces its Python modules import, for Python 3.11, installed beside
# the project's venv (never into it): its torch, transformers and TRL stay the venv's. vLLM's config, sampling and
# output objects then import on a CPU-only machine (no engine starts). Use:
#   bash benchmarks/vllm031_cpu_site.sh [VLLM_WHEEL] [SITE]      # SITE defaults to /tmp/v31site
#   PYTHONPATH=SITE HF_HUB_OFFLINE=1 python -m pytest -q tests/root/test_vllm031_objects.py
# VLLM_WHEEL: vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl (downloaded from PyPI when omitted). Needs PyPI.
set -euo pipefail
PY=${PY:-python}
WHEEL=${1:-vllm==0.31.0}
SITE=${2:-/tmp/v31site}
DL=$(mktemp -d)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 -d "$DL" \
  msgspec==0.23.0 blake3==1.0.11 cbor2==6.3.0 pybase64==1.5.1 setproctitle==1.3.8 pyzmq==27.3.0 py-cpuinfo==9.0.0 \
  einops==0.8.2 apache-tvm-ffi==0.1.11 xgrammar==0.2.7 llguidance==1.7.6 uvloop==0.23.0 httpx2==2.16.2 \
  openai==3.57.0 oss-harmony==0.0.11 python-json-logger==4.2.0 partial-json-parser==0.2.1.1.post7
case "$WHEEL" in *.whl) cp "$WHEEL" "$DL"/ ;; *) "$PY" -m pip download -q --no-deps -d "$DL" "$WHEEL" ;; esac
"$PY" -m pip install -q --no-deps --target "$SITE" "$DL"/*.whl
rm -rf "$DL"
PYTHONPATH="$SITE" "$PY" -c "import vllm.outputs, vllm.config, vllm.entrypoints.llm; print('vLLM', vllm.__version__, 'imports from $SITE')"
