#!/usr/bin/env bash
# The one-shot GPU check of issue 20 (benchmarks/gpu_check.py), at most 5 minutes, each section
# time-boxed, results flushed to one folder as they come. From the repository root on the lent
# machine, with its own PyTorch (no install; nothing to fetch); give the device tool timeout_s >= 330:
#   bash benchmarks/gpu_check.sh                  # results in $OUT/gpu_check (or results/gpu_check)
#   bash benchmarks/gpu_check.sh --sections env,decode
# The made models (seeded random weights, ~5 GB) go to a temporary folder, not the results.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-results}/gpu_check"
mkdir -p "$out"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
# our C++ kernels are CPU code: building them there (the CPU reference run, an int4 head before it
# moves) would spend the time boxes on a compiler
export MIXSERVE_NO_CPP_KERNELS=1
# --device cuda: a GPU PyTorch cannot see is an error, not five minutes of the CPU (later args win)
timeout -k 10 295 python3 benchmarks/gpu_check.py --device cuda --out "$out" --work /tmp/mixserve-gpu-check-models "$@" \
  2>&1 | tee "$out/log.txt"
rc=${PIPESTATUS[0]}
echo "gpu_check: exit $rc; results in $out"
exit "$rc"
