"""Smoke tests of the benchmarks' code paths on tiny sizes (experiments.bench).

The timings themselves are not tested (they depend on the machine); what is: every path runs in
its child processes, the figures it reports are consistent (the reference method's ratio is 1),
wire bytes match the closed forms of each exchange, state memory matches the state's layout,
and the results files carry the table with its goal column.
"""

import importlib.util
import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from compressors import registry
from experiments import cli
from experiments import provenance
from experiments.bench import __main__ as bench
from experiments.bench import bytes as bench_bytes
from experiments.bench import calibrate
from experiments.bench import common as bench_common
from experiments.bench import compression as bench_compression
from experiments.bench import gpu_traffic
from experiments.bench import links as bench_links
from experiments.bench import step as bench_step
import tasc


@pytest.mark.parametrize("text,elements", [
    ("1m", 1_000_000), ("resnet50", 25_557_032), ("bert_base", 109_482_240), ("4096", 4096),
    ("25.6m", 25_600_000), ("4k", 4000)])
def test_parse_size(text, elements):
  assert bench_common.parse_size(text) == elements


@pytest.mark.parametrize("bad", ["", "-3", "big", "0"])
def test_parse_size_rejects(bad):
  with pytest.raises(ValueError, match="--sizes"):
    bench_common.parse_size(bad)


def test_unknown_method_is_named():
  with pytest.raises(ValueError, match="'nope'.*allowed"):
    bench_common.check_methods(["dense", "nope"])


def test_methods_come_from_the_registry():
  assert bench_common.all_methods() == tuple(
      n for n in registry.names() if registry.get(n).family == "per_step")
  assert {"dense", "topk", "tasc"} <= set(bench_common.all_methods())
  assert not {"diloco", "demo", "onebit_adam"} & set(bench_common.all_methods())
  assert {"dense", "tasc", "fp16", "threshold"} <= set(bench_common.all_methods())


@pytest.mark.parametrize("call", [
    lambda: bench_bytes.bytes_vs_workers([2], ["32768"], ["dense", "tasc_flat"]),
    lambda: bench_links.link_times([2], 1024, ["dense", "tasc_flat"], rate_bits=None)])
def test_bytes_and_links_refuse_unknown_rows_before_anything_runs(call):
  with pytest.raises(ValueError, match="'tasc_flat' is not a benchmarked method; allowed: "
                                       r"\['dense', 'topk'"):
    call()


def test_cli_runs_as_a_module(tmp_path):
  """``python -m experiments.bench`` (the package's __main__), as the README says."""
  result = subprocess.run([sys.executable, "-m", "experiments.bench", "bytes", "--workers", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, check=False,
                          cwd=bench_common.REPO_ROOT, env=bench_common.cpu_env(1))
  assert result.returncode == 1 and "--workers: 1; allowed: ints >= 2" in result.stderr


@pytest.mark.parametrize("argv, message", [
    (["compression", "--sizes", "0.0001"], "--sizes: '0.0001' is not a size of at least one "
     "element; allowed: ['1m', 'bert_base', 'resnet50'], a positive int, or a number with k/m"),
    (["compresion"], "argument name: invalid choice: 'compresion' (choose from 'compression', "),
    (["step", "--repeats", "x"], "argument --repeats: invalid int value: 'x'"),
    (["compression", "--timeout", "nan"], "--timeout=nan; allowed: a finite number > 0"),
    (["compression", "--workers", "4"], "--workers is read by bytes, not by compression"),
    # Refused before the hours of the benchmarks that come first.
    (["all", "--workers", "1"], "--workers: 1; allowed: ints >= 2"),
    (["all", "--sizes", "1m"], "--sizes: '1m' is not a gradient; allowed: resnet50, bert_base"),
    (["links", "--rate", "1.2.3"], "--rate='1.2.3' is not a rate; allowed: e.g. 1gbit"),
    (["step", "--models", "resnet18"], "--models: 'resnet18' is not benchmarked; allowed: "),
])
def test_bad_arguments_are_one_line_before_any_benchmark_runs(argv, message, tmp_path,
                                                              monkeypatch):
  monkeypatch.delenv(cli.VERBOSE_ENV, raising=False)
  with pytest.raises(SystemExit) as exited:
    bench.main([*argv, "--out", str(tmp_path / "out")])
  assert exited.value.code.startswith(f"experiments.bench: {message}"), exited.value.code
  assert "\n" not in exited.value.code and not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_is_one_line_before_any_benchmark_runs(tmp_path, monkeypatch,
                                                                     capsys):
  """Checked first: not after the benchmark's rows have printed, when the files are written."""
  monkeypatch.delenv(cli.VERBOSE_ENV, raising=False)
  results = tmp_path / "results"
  results.write_text("")
  for out, why in [(results, ""), (results / "b3", f" ({results} is a file)")]:
    with pytest.raises(SystemExit) as exited:
      bench.main(["bytes", "--out", str(out)])
    assert exited.value.code == (
        f"experiments.bench: --out={str(out)!r} is not a folder{why}; allowed: a folder, or a "
        "path where one can be made, for <name>.json and <name>.md")
  assert capsys.readouterr().out == ""


@pytest.mark.slow  # a variant of the bench's tables
def test_compression_cli_writes_table_with_goal(tmp_path, capsys):
  size = 65536
  written = bench.main(["compression", "--sizes", str(size), "--methods", "topk", "tasc",
                        "signsgd", "--repeats", "1", "--out", str(tmp_path)])
  assert sorted(p.name for p in written) == ["compression.json", "compression.md"]
  rows = json.loads((tmp_path / "compression.json").read_text())["rows"]
  assert [r["method"] for r in rows] == ["topk", "tasc", "signsgd"]
  for r in rows:
    assert r["ratio"] > 0 and r["floor_seconds"] > 0 and r["elements"] == size
  assert rows[0]["vs_topk"] == rows[0]["compress_vs_topk"] == 1.0
  for r in rows[:2]:  # error feedback: compression timed apart
    assert r["compress_ratio"] > 0 and r["compress_seconds"] > 0
  assert "compress_ratio" not in rows[2] and "compress_vs_topk" not in rows[2]
  assert rows[1]["pass_bound_ratio"] > 0 and "pass_bound_ratio" not in rows[0]
  assert rows[1]["one_pass_kernel"] is True and "one_pass_kernel" not in rows[0]
  settings = json.loads((tmp_path / "compression.json").read_text())["settings"]
  assert settings["platform"] == rows[0]["platform"] == "cpu"
  assert settings["device"] == rows[0]["device"] and settings["jax"] == rows[0]["jax"]
  # TASC's state: the f32 residual, one f32 curvature per 256-element block, count and key.
  blocks = size // 256
  assert rows[1]["state_bytes_per_param"] == pytest.approx((4 * size + 4 * blocks + 12) / size)
  assert rows[0]["state_bytes_per_param"] == pytest.approx((4 * size + 12) / size)
  markdown = (tmp_path / "compression.md").read_text()
  assert "| goal |" in markdown and "| compress / floor |" in markdown
  origin = json.loads((tmp_path / "compression.json").read_text())[provenance.KEY]
  assert len(origin["commit"]) == 40 and origin["device_kinds"] == ["cpu"]
  assert (origin["num_workers"], origin["process_count"]) == (1, 1)
  assert f"Command: `{origin['command']}`" in markdown
  assert f"Commit: `{provenance.commit_text(origin)}`" in markdown
  assert capsys.readouterr().out.rstrip().endswith(markdown.rstrip().splitlines()[-1])


def test_compression_goal_column():
  cpu, gpu = bench_compression.GOALS["cpu"], bench_compression.GOALS["gpu"]
  # On CPU, on compression alone: the decode's ratio and speed-up do not count.
  row = {"method": "tasc", "size": bench_compression.GOAL_SIZE, "ratio": 1.0, "vs_topk": 30.0,
         "compress_ratio": 2.0, "compress_vs_topk": 9.0}
  assert bench_compression._goal(row, cpu) == (
      "missed (compress <= 1.5x floor); missed (compress >= 10x cheaper than exact top-k's)")
  row.update(compress_ratio=1.5, compress_vs_topk=10.0)
  assert bench_compression._goal(row, cpu) == (
      "met (compress <= 1.5x floor); met (compress >= 10x cheaper than exact top-k's)")
  assert bench_compression._goal({"method": "tasc", "size": bench_compression.GOAL_SIZE,
                                  "skipped": "slow"}, cpu).startswith("not measured")
  assert bench_compression._goal({"method": "topk", "size": 5, "ratio": 1.0}, cpu) == ""
  # On GPUs: compress and compress + decode at 25.6M and 109M, top-k's at 109M on both.
  assert bench_compression._goal(dict(row, ratio=1.7, compress_ratio=1.2), gpu) == (
      "met (compress <= 1.3x floor); missed (compress + decode <= 1.6x floor)")
  big = {"method": "tasc", "size": bench_common.SIZES["bert_base"], "ratio": 1.5,
         "compress_ratio": 1.25, "vs_topk": 12.0}
  assert bench_compression._goal(big, gpu) == (
      "met (compress <= 1.3x floor); met (compress + decode <= 1.6x floor); "
      "met (compress + decode >= 10x cheaper than exact top-k's)")


def test_platform_is_checked_and_resolved():
  assert bench_common.resolve_platform("cpu") == "cpu"
  with pytest.raises(ValueError, match=r"--platform='tpu'; allowed: \['cpu', 'gpu', 'auto'\]"):
    bench_common.resolve_platform("tpu")
  # Without a GPU (CI never has one) auto falls back and gpu says why it cannot run.
  if bench_common.resolve_platform("auto") == "gpu":
    assert bench_common.resolve_platform("gpu") == "gpu"
    return
  with pytest.raises(ValueError, match="--platform=gpu: JAX finds no GPU here"):
    bench_common.resolve_platform("gpu")


# Small enough to compile in seconds, large enough for TASC's 1% of 256-element blocks.
TINY_MODELS = {"resnet20": {"depth": 8, "width": 8},
               "bert_tiny": {"hidden": 16, "num_layers": 1, "num_heads": 2, "intermediate": 32,
                             "vocab_size": 1024, "max_length": 128}}


@pytest.mark.parametrize("model, devices", [
    # Eight devices (slow: the simulated workers below exercise the same step and more).
    pytest.param("bert_tiny", None, marks=pytest.mark.slow),
    ("bert_tiny", 1),  # the 8 workers simulated on one device, as on one GPU
    # Batch-norm statistics per worker; its convolutions compile for about a minute.
    pytest.param("resnet20", 2, marks=pytest.mark.slow)])
@pytest.mark.slow  # each variant a minute of timing
def test_step_overhead_tiny(model, devices):
  rows = bench_step.step_overhead([model], ["tasc"], repeats=1, batch_size=8,
                                  model_overrides=TINY_MODELS, devices=devices,
                                  log=lambda _: None)
  assert [(r["model"], r["method"]) for r in rows] == [(model, "dense"), (model, "tasc")]
  for r in rows:
    assert r["seconds"] > 0 and r["batch_size"] == 8 and r["platform"] == "cpu"
    assert (r["devices"], r["workers_per_device"]) == ((8, 1) if devices is None
                                                       else (devices, 8 // devices))
  assert rows[0]["ratio"] == 1.0
  assert rows[1]["goal"].split()[0] in ("met", "missed")
  # Modelled on 10 Gbit/s: dense float32 is its own baseline; the fair one (bf16, overlapped)
  # is quicker, so every step is a larger multiple of it.
  assert rows[0]["vs_dense_f32"] == 1.0 and rows[0]["vs_dense_bf16_overlapped"] > 1.0
  for r in rows:
    assert r["modelled_seconds"] > r["seconds"]
    assert r["vs_dense_bf16_overlapped"] > r["vs_dense_f32"]


def test_bytes_match_closed_forms():
  n, rows_count, cols = 4, 512, 64
  d = rows_count * cols
  rows = bench_bytes.bytes_vs_workers([n], [f"{rows_count}x{cols}"], group=2,
                                      log=lambda _: None)
  got = {r["method"]: r for r in rows}
  assert not [r for r in rows if "error" in r], rows
  all_reduce = lambda words: 2 * (n - 1) / n * 4 * words
  k = round(0.01 * d)
  blocks = d // 256
  assert got["dense"]["bytes_per_device"] == all_reduce(d)
  assert got["randomk"]["bytes_per_device"] == all_reduce(k)
  assert got["topk"]["bytes_per_device"] == (n - 1) * k * (4 + 4)  # values and int32 indices
  assert got["tasc"]["bytes_per_device"] == all_reduce(round(0.01 * blocks) * 256 + blocks)
  rank = 4
  assert got["powersgd"]["bytes_per_device"] == all_reduce(rank * (rows_count + cols))
  # Hierarchical: the slow axis (2 nodes) carries TASC of one node's half of the gradient.
  shard_blocks = d // 2 // 256
  assert got["tasc_hierarchical"]["slow_axis_bytes"] == 2 * (2 - 1) / 2 * 4 * (
      round(0.01 * shard_blocks) * 256 + shard_blocks)
  assert got["dense"]["vs_dense"] == 1.0


def test_bytes_hierarchical_needs_two_nodes():
  rows = bench_bytes.bytes_vs_workers([2], ["32768"], ["dense", "tasc_hierarchical"],
                                      log=lambda _: None)
  assert "skipped" in rows[1] and "at least 16" in rows[1]["skipped"]


def test_gradient_shapes_of_resnet50():
  shapes = bench_bytes.gradient_shapes("resnet50")
  assert sum(math.prod(s) for s in shapes.values()) == 25_557_032
  with pytest.raises(ValueError, match="--sizes"):
    bench_bytes.gradient_shapes("3x4x5")


# The rate-limited link (needs network namespaces) is the calibration's: the slow suite's.
@pytest.mark.parametrize("rate_bits", [None, pytest.param(1e9, marks=pytest.mark.slow)])
@pytest.mark.slow  # multi-process
def test_links_two_processes(rate_bits):
  if rate_bits is not None and not calibrate.netns_available()[0]:
    pytest.skip("no permission for network namespaces here")
  size = 65536
  rows = bench_links.link_times([2], size, rate_bits=rate_bits, repeats=1, timeout_s=300,
                                log=lambda _: None)
  got = {r["method"]: r for r in rows}
  assert set(got) == set(bench_links.METHODS)
  assert got["tasc_previous"]["bytes_per_device"] == got["tasc"]["bytes_per_device"]
  # float16 scores and payload: half, plus each worker's bound for the scale (a float32 in an
  # all-reduce of its own; a float16 in the payload).
  assert got["tasc_f16"]["bytes_per_device"] == got["tasc"]["bytes_per_device"] / 2 + 4
  assert got["tasc_previous_f16"]["bytes_per_device"] == got["tasc"]["bytes_per_device"] / 2 + 2
  assert got["dense"]["bytes_per_device"] == 4 * size  # 2 (n-1)/n of the buffer, n = 2
  assert got["dense"]["speedup"] == 1.0
  assert all(r["seconds"] > 0 for r in rows)
  assert all(got[m]["goal"].split()[0] in ("met", "missed") for m in got if m.startswith("tasc"))


# --- The memory-traffic model of compiled programs (gpu_traffic): its rules, checked on programs
# compiled for this machine's CPU, whose optimised HLO has the same form as a GPU's.
def _traffic(fn, donate, *args) -> int:
  return gpu_traffic.traffic(jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text())


def test_traffic_model_counts_array_and_tuple_types():
  assert gpu_traffic.shape_bytes("f32[4,8]{1,0}") == 128
  assert gpu_traffic.shape_bytes("(f32[2]{0}, pred[3]{0})") == 11
  assert gpu_traffic.shape_bytes("s32[]") == 4


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_traffic_model_of_the_floor_and_the_pass_bound():
  """``e + g`` moves two reads and a write; TASC's pass bound one more write (4/3 of it)."""
  size = 1 << 16
  x = jax.ShapeDtypeStruct((size,), jnp.float32)
  floor = _traffic(lambda e, g: e + g, (0, 1), x, x)
  assert floor == 3 * 4 * size
  bound = _traffic(bench_compression.tasc_pass_bound, (0, 1), x, x)
  assert bound == pytest.approx(4 / 3 * floor, rel=1e-3)


def test_windowed_variant_lowers_tasc_block_sums_as_the_cpu_does_and_only_inside():
  """The model's "windowed block sums" variant (``tasc.cpu_block_sums_everywhere``): lowered for
  CUDA inside it, TASC's block energies are the CPU's windowed sum; outside it, before and
  after, the GPU form's plain reduction. A fresh function each time, as the model builds each
  program afresh, so that no trace is reused."""
  x = jax.ShapeDtypeStruct((1 << 16,), jnp.float32)

  def lowered_for_cuda() -> str:
    energies = jax.jit(lambda v: tasc.block_scores(v, block_size=256))
    return energies.trace(x).lower(lowering_platforms=("cuda",)).as_text()

  assert "reduce_window" not in lowered_for_cuda()
  with tasc.cpu_block_sums_everywhere():
    assert "reduce_window" in lowered_for_cuda()
  assert "reduce_window" not in lowered_for_cuda()


def test_traffic_model_charges_an_in_place_update_its_windows_only():
  """A scatter of 16 rows into a donated buffer moves the rows and indices, not the buffer."""
  size = 1 << 16
  moved = _traffic(lambda b, i, r: b.at[i].set(r), (0,), jax.ShapeDtypeStruct((size,), jnp.float32),
                   jax.ShapeDtypeStruct((16,), jnp.int32), jax.ShapeDtypeStruct((16,), jnp.float32))
  assert 0 < moved < 1000


def test_traffic_model_charges_a_slice_of_an_elementwise_result_the_slice_only():
  """The tail block's energy (square, then the last 39 elements) reads 39 elements, not all."""
  moved = _traffic(lambda x: jnp.sum(jnp.square(x)[-39:]), (),
                   jax.ShapeDtypeStruct((1 << 16,), jnp.float32))
  assert 0 < moved < 1000


@pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is not None,
                    reason="the CUDA plugin is installed: the compile-only H100 can be made")
def test_traffic_model_without_the_cuda_plugin_says_what_to_install():
  with pytest.raises(SystemExit, match="jax-cuda12-plugin=="):
    gpu_traffic.h100()
