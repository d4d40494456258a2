#!/usr/bin/env bash
# Everything fdp checks on a lent GPU machine, in one go within ~10 minutes (see benchmarks/README.md):
# GPT-2 124M time and memory against eager torch and torch.compile, the `gpu` tests, then the whole suite.
# Needs the wheels that machine lacks in .whl/ (../shared/gpu/prepare.sh); results go to $OUT (or /tmp/gpu_session).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_session}; mkdir -p "$OUT"
start=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - start) )); }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
echo "== GPT-2 124M bf16 ($(left 0)s)"
timeout 250 python3 benchmarks/gpu_gpt2.py --snapshot /tmp/snap 2>&1 | grep -v '^\[transformers\]' | tee "$OUT/gpt2.txt"
echo "== gpu tests ($(left 0)s)"
timeout 80 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --ignore=tests/test_notebooks.py 2>&1 | tail -6 | tee "$OUT/gpu_tests.txt"
budget=$(left ${SESSION_S:-570})
echo "== whole suite, $budget s left"
timeout "$budget" python3 -m pytest -q -n 15 -p no:cacheprovider --timeout 150 -rfE --durations=15 \
  -o console_output_style=count 2>&1 | grep -v '^\[transformers\]' > "$OUT/suite.txt"
echo "suite exit $?"; tail -60 "$OUT/suite.txt"
