#!/usr/bin/env bash
# Everything fdp checks on a lent GPU machine, in one call of under ~9.5 minutes (see benchmarks/README.md):
# the whole suite (the `gpu` tests included) on cores 0-11, named test by test, while GPT-2 124M's throughput,
# profile and fp8 figures (benchmarks/gpu_throughput.py) run on cores 12-15 beside it.
# Needs the wheels that machine lacks in .whl/ (../shared/gpu/prepare.sh); results go to $OUT (or /tmp/gpu_session).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_session}; mkdir -p "$OUT"
SUITE_S=${SUITE_S:-500}; BENCH_S=${BENCH_S:-480}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=4
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
# The suite, every test named as it ends (-v), so a run cut short still lists what failed; SIGINT at its limit
# makes pytest print its summary of what ran, and failures.txt gets each failure as it happens. mlflow's stack is too large to carry: its one test is left out.
FDP_FAILURES="$OUT/failures.txt" taskset -c 0-11 timeout -s INT -k 20 "$SUITE_S" python3 -m pytest -v -n 11 -p no:cacheprovider --timeout 150 \
  -rfE --tb=short --durations=20 --ignore=tests/docs/test_notebooks.py -p benchmarks.failures_plugin \
  --deselect tests/run/test_loggers.py::test_a_run_stopped_and_resumed_logs_to_csv_and_one_mlflow_run_with_its_settings \
  > "$OUT/suite.txt" 2>&1 &
suite=$!
taskset -c 12-15 timeout "$BENCH_S" python3 benchmarks/gpu_throughput.py --out "$OUT" 2>&1 \
  | grep -v '^\[transformers\]' | tee "$OUT/throughput.txt"
wait $suite; echo "suite exit $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/suite.txt" | tail -60
