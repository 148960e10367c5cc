#!/usr/bin/env bash
# The GPU checks and figures in one run, for a short lease of one NVIDIA GPU (about 6 minutes):
#   bash benchmarks/gpu.sh [OUT]      (default OUT: benchmarks/results/gpu)
# 1. `pytest -m gpu` but its quickstart test (TASC's passes on the GPU against a float64
#    reference); 2. the README's quickstart, unchanged; 3. B1 at 25.6M and 109M (TASC, top-k,
#    dense); 4. B2 for BERT-base with 8 simulated workers. Each step has its own time limit and the run
#    goes on past a failed one; its log says which failed. B2 compiles BERT-base three times (about
#    170 s on an H200 on 2026-11-28, past the 160 s limit it had): its limit leaves room for that.
# A GPU machine without the internet installs the packages it lacks from .gpu_wheels/ when that
# folder is there (pip download ml-collections mnist1d tensorboardX for its Python).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d .gpu_wheels ]; then
  python -m pip install -q --no-index --find-links .gpu_wheels ml-collections mnist1d tensorboardX
fi
step() {  # step NAME SECONDS COMMAND...: runs COMMAND with a limit, logs to OUT/NAME.log
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/steps.txt"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import sys, jax, jaxlib; print(sys.version.split()[0], jax.__version__, jaxlib.__version__, jax.devices())"
} > "$OUT/machine.txt" 2>&1
: > "$OUT/steps.txt"
step pytest_gpu 80 env JAX_PLATFORMS=cuda,cpu python -m pytest -q -m gpu -n 0 -p no:cacheprovider \
  -k "not quickstart"  # the quickstart runs next, from its command line
step quickstart 90 python -m experiments.run --config=configs/quickstart.py \
  --workdir="${TMPDIR:-/tmp}/tasc-gpu-quickstart"
cp "${TMPDIR:-/tmp}/tasc-gpu-quickstart/results.json" "$OUT/quickstart_results.json" 2>/dev/null
step b1 150 python -m experiments.bench compression --platform gpu --sizes resnet50 bert_base \
  --methods tasc topk dense --repeats 10 --out "$OUT"
step b2 300 python -m experiments.bench step --platform gpu --models bert_base \
  --methods dense tasc topk --repeats 5 --out "$OUT"
