#!/usr/bin/env bash
# The language model's GPU tier in one short lease of one NVIDIA GPU: the 29.5M decoder
# (configs/paper/lm.py:tier=gpu, bfloat16 matrix products), 8 workers simulated on the GPU, one
# seed, STEPS steps, the rows given as arguments run side by side (each its own process with a
# share of the GPU's memory), each with a time limit:
#   bash benchmarks/gpu_lm.sh OUT STEPS LIMIT NAME=ARGS [NAME=ARGS ...]
# e.g. bash benchmarks/gpu_lm.sh benchmarks/results/gpu_lm 1000 420 dense=method=dense \
#        diloco_h100=method=diloco
# ARGS are configs/paper/lm.py's arguments (ratio=100 unless given). OUT/NAME/ gets each run's
# results.json, config.json and metrics.jsonl; OUT/steps.txt their exits and times.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$1 STEPS=$2 LIMIT=$3 TIER=${TIER:-gpu}  # TIER=cpu tries the script on a CPU
shift 3
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Each run takes its share of the GPU's memory instead of XLA's default 75% for the first.
export XLA_PYTHON_CLIENT_MEM_FRACTION=$(python -c "print(round(0.9 / $#, 3))")
if [ -d .gpu_wheels ]; then
  python -m pip install -q --no-index --find-links .gpu_wheels ml-collections mnist1d tensorboardX
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import sys, jax, jaxlib; print(sys.version.split()[0], jax.__version__, jaxlib.__version__, jax.devices())"
} > "$OUT/machine.txt" 2>&1
: > "$OUT/steps.txt"
CACHE=${TMPDIR:-/tmp}/tasc-gpu-lm-cache
# The tokenizer once, before the runs share it.
python -c "from configs.paper import lm; from experiments import data; \
c = lm.get_config('tier=$TIER,cache=$CACHE'); data.load(c, data.ShardSpec(8, tuple(range(8))))" \
  > "$OUT/tokenizer.log" 2>&1
for row in "$@"; do
  name=${row%%=*} args=${row#*=}
  work=${TMPDIR:-/tmp}/tasc-gpu-lm/$name
  ( start=$SECONDS
    timeout "$LIMIT" python -m experiments.run \
      --config="configs/paper/lm.py:tier=$TIER,ratio=100,cache=$CACHE,$args" \
      --config.num_steps="$STEPS" --config.eval_every=$((STEPS / 4)) \
      --config.checkpoint_every=0 --workdir="$work" \
      > "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s" >> "$OUT/steps.txt"
    mkdir -p "$OUT/$name"
    cp "$work"/{results.json,config.json,metrics.jsonl} "$OUT/$name/" 2>/dev/null
    tr '\r' '\n' < "$OUT/$name.log" | grep -v "step/s" | tail -40 > "$OUT/$name.tail"
    rm -f "$OUT/$name.log" ) &
done
wait
