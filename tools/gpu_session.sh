#!/bin/bash
# On a lent GPU machine without network: install the wheels carried in .whl/ (into .site/, on
# PYTHONPATH) and Tessera itself, then run `make gpu-check` with the report written to $OUT
# (the device tool's folder that comes back) or bench/results/. Arguments go to gpu_check.py.
set -u
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --target "$PWD/.site" .whl/*.whl
    export PYTHONPATH="$PWD/.site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
export PYTHONUNBUFFERED=1
make gpu-check PYTHON=python3 GPU_CHECK_ARGS="--out ${OUT:-bench/results} $*"
