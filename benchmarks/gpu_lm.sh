#!/usr/bin/env bash
# The language model's GPU tier (T1-LM-GPU, F5-GPU) on the tier's corpus, the Python source of 15
# pinned PyPI packages, for a lease of one NVIDIA GPU:
#   bash benchmarks/gpu_lm.sh [SECONDS] [WORKDIR] [JOBS]
#   (defaults: 540, paper_figures/gpu_runs_pypi, 7)
# Runs `python -m experiments.reproduce --target=t1_lm --tier=gpu --jobs=JOBS` in WORKDIR: dense,
# solo and configs/paper/t1_lm.py's GPU_ROWS, 1,000 steps each, by default all seven at once, so
# that their compiles overlap: two at once, they took about 14 minutes of one H200 (2026-11-28);
# eight runs of the CPU tier's model at once on one H200 spent about 3 minutes compiling, then
# trained at 30-46 steps a second each (2026-11-30). A leased machine's calls are limited in time
# (10 minutes on ours), so the runs are stopped after SECONDS and the finished ones come back in
# $OUT/lm_gpu_runs.tgz (OUT: the device's, else /tmp/gpu_lm):
# unpack it here (`tar xzf lm_gpu_runs.tgz -C WORKDIR`) and call again; finished runs are
# skipped, an unfinished one starts over. Then, here:
#   python -m experiments.reproduce --target=t1_lm,f5 --tier=gpu --report_only --workdir=WORKDIR
# The machine has no network: carry .pypi_corpus/archives (25.3 MB, fetched here by
# `python -m experiments.data.pypi_corpus --cache_dir=.pypi_corpus`) and .gpu_wheels (see
# benchmarks/gpu.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
LIMIT=${1:-540}
WORK=${2:-paper_figures/gpu_runs_pypi}
JOBS=${3:-7}
OUT=${OUT:-/tmp/gpu_lm}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -d .gpu_wheels ]; then
  python -m pip install -q --no-index --find-links .gpu_wheels ml-collections mnist1d tensorboardX
fi
# The runs read the corpus from its default cache folder (configs/lm_stdlib.py's corpus_dir='').
CACHE=$(python -c "from experiments.data import pypi_corpus; print(pypi_corpus.default_cache_dir())")
if [ -d .pypi_corpus/archives ]; then
  mkdir -p "$CACHE/archives" && cp -n .pypi_corpus/archives/* "$CACHE/archives/"
fi
python -m experiments.data.pypi_corpus --offline --cache_dir="$CACHE" || exit 1
start=$SECONDS
timeout -s TERM "$LIMIT" python -m experiments.reproduce --target=t1_lm --tier=gpu --jobs="$JOBS" \
  --workdir="$WORK"
echo "t1_lm: exit $? after $((SECONDS - start)) s"
# A finished run's three files and every log: what the reports read (checkpoints stay behind).
(cd "$WORK" && {
  find . -path '*/logs/*.log' -o -name failures.json -o -name summary.csv
  find . -name results.json | while read -r results; do
    run=$(dirname "$results")
    printf '%s\n' "$results" "$run/config.json" "$run/metrics.jsonl"
  done
} | tar czf "$OUT/lm_gpu_runs.tgz" -T -)
tar tzf "$OUT/lm_gpu_runs.tgz" | grep -c results.json | sed 's/^/finished runs: /'
