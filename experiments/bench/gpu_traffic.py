"""B1's programs compiled for an NVIDIA H100 on a machine without one: modelled memory traffic.

XLA compiles for a GPU it does not have when the CUDA PJRT plugin is given a target description
(deviceless compilation: no GPU, no driver). This script compiles B1's programs
(:mod:`experiments.bench.compression`: the floor ``e + g``, and a method's compress and compress +
decode on one ``f32[d]`` gradient) for one H100 that way and reads the optimised program XLA
would run: its kernels, and the bytes each moves through the GPU's memory.

A kernel's traffic is what it reads, the parts of its operands it slices or the whole operand
otherwise, but nothing of a buffer it updates in place; plus what it writes, the windows of an
in-place update or the whole output otherwise. The figure is the program's traffic over the
floor's, so 1.0 is the least an error-feedback compressor can move. This is a model, not a
measurement: it leaves out each kernel's launch, a sort's own passes (a deviceless compile sorts
with XLA's fallback, not CUB, so sorts are counted as one pass over their operands), caches, and
how near each kernel comes to the memory's bandwidth. What it shows is the passes XLA makes:
whether the block energies are fused into the pass that writes ``g + e``.

Run with the CUDA plugin of the installed jaxlib's version, without the NVIDIA libraries::

  pip install "jax-cuda12-plugin==$(python -c 'import jaxlib; print(jaxlib.__version__)')" \\
      "jax-cuda12-pjrt==$(python -c 'import jaxlib; print(jaxlib.__version__)')"
  JAX_PLATFORMS=cpu python -m experiments.bench.gpu_traffic --out benchmarks/results/gpu_model

(``JAX_PLATFORMS=cpu`` keeps JAX from looking for a GPU; the plugin is still loaded for the
compile-only device.) The installed plugin makes every JAX start on a machine without a GPU warn
that CUDA cannot be loaded: uninstall it afterwards, or install it in a separate environment.
"""

import argparse
import contextlib
import json
import math
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import jaxlib
from jax.experimental import topologies

from experiments import provenance
from experiments.bench import common
from experiments.bench import compression
import tasc

# One H100 SXM (80 GB HBM3), as XLA's GpuTargetConfigProto describes a GPU: the figures XLA's
# fusion and tiling decisions read (NVIDIA's published specifications of the part).
H100 = """
gpu_device_info {
  threads_per_block_limit: 1024  threads_per_warp: 32
  shared_memory_per_block: 49152  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048  core_count: 132  fpus_per_core: 128
  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000  l2_cache_size: 52428800  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 1 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
GPU_NAME = re.search(r'device_description_str: "(.*)"', H100).group(1)
# B1's sizes, and BERT-base's fused gradient (all 109,514,298 parameters, 2 mod 4): a size whose
# block energies cannot share the sum's pass (tasc._scores.block_sums).
SIZES = ("resnet50", "bert_base", "109514298")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
               "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# Operations computed element by element: a kernel computes only the elements of their results
# that it uses.
ELEMENTWISE = {"abs", "add", "and", "ceil", "clamp", "compare", "convert", "cosine", "divide",
               "exponential", "floor", "log", "maximum", "minimum", "multiply", "negate", "not",
               "or", "power", "rsqrt", "select", "sign", "sine", "sqrt", "subtract", "tanh", "xor"}
# Entry-level instructions that launch no kernel.
NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
             "opt-barrier"}
_INSTRUCTION = re.compile(r"^\s+(ROOT )?%(\S+) = (.+?) ([\w-]+)\((.*?)\)(, .*)?$")
_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) \(.*\{$")


def h100() -> jax.Device:
  """A compile-only H100 (needs the CUDA plugin; no GPU)."""
  try:
    topology = topologies.get_topology_desc("h100", "cuda", target_config=H100,
                                            topology="1x1x1")
  except (NotImplementedError, RuntimeError) as error:
    raise SystemExit(
        f"gpu_traffic: cannot make a compile-only H100 ({type(error).__name__}: {error}); it "
        f"needs the CUDA plugin of jaxlib {jaxlib.__version__}: pip install "
        f"jax-cuda12-plugin=={jaxlib.__version__} jax-cuda12-pjrt=={jaxlib.__version__}") from error
  return topology.devices[0]


def _arrays(hlo_type: str):
  """``(dtype, elements)`` of each array of an HLO type: ``f32[4,8]{1,0}`` or a tuple of arrays."""
  for m in re.finditer(r"\b(\w+)\[([\d,]*)\]", hlo_type):
    if m.group(1) in DTYPE_BYTES:
      yield m.group(1), math.prod(int(d) for d in m.group(2).split(",") if d)


def shape_bytes(hlo_type: str) -> int:
  """Bytes of an HLO type: an array ``f32[4,8]{1,0}`` or a tuple of arrays."""
  return sum(DTYPE_BYTES[dtype] * count for dtype, count in _arrays(hlo_type))


def elements(hlo_type: str) -> int:
  """Elements of an HLO array type (of all arrays of a tuple type)."""
  return sum(count for _, count in _arrays(hlo_type))


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
  """The optimised HLO module's computations by name (their instruction lines), and the entry's
  name."""
  computations, entry, current = {}, None, None
  for line in hlo.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None:
      computations[current].append(line)
  return computations, entry


def _instructions(lines: list[str]) -> dict[str, dict]:
  out = {}
  for line in lines:
    m = _INSTRUCTION.match(line)
    if m:
      out[m.group(2)] = {"name": m.group(2), "root": bool(m.group(1)), "type": m.group(3),
                         "op": m.group(4), "args": re.findall(r"%([\w.\-]+)", m.group(5)),
                         "line": line}
  return out


def _fusion_traffic(lines: list[str]) -> int:
  """Bytes one fused kernel reads and writes (the module docstring's rules)."""
  instructions = _instructions(lines)
  users: dict[str, list[dict]] = {}
  for instruction in instructions.values():
    for arg in instruction["args"]:
      users.setdefault(arg, []).append(instruction)
  root = next(i for i in instructions.values() if i["root"])
  outputs = {root["name"], *(root["args"] if root["op"] == "tuple" else ())}

  def demanded(name: str) -> int:
    """Elements of ``name``'s value the kernel reads: those its slices take (through bitcasts
    and elementwise operations), none where it is updated in place, all of them otherwise."""
    size = elements(instructions[name]["type"])
    if name in outputs:
      return size
    taken = 0
    for user in {u["name"]: u for u in users.get(name, [])}.values():
      if user["op"] in ("slice", "dynamic-slice", "gather"):
        taken += elements(user["type"])
      elif user["op"] == "bitcast" or (user["op"] in ELEMENTWISE
                                       and elements(user["type"]) == size):
        taken += demanded(user["name"])
      elif not (user["op"] in ("scatter", "dynamic-update-slice") and user["args"][0] == name):
        return size
    return min(taken, size)

  moved = sum(demanded(name) * shape_bytes(i["type"]) // max(elements(i["type"]), 1)
              for name, i in instructions.items() if i["op"] == "parameter")
  for output in ([instructions[a] for a in root["args"]] if root["op"] == "tuple" else [root]):
    if output["op"] in ("scatter", "dynamic-update-slice"):  # in place: the updated windows
      update = output["args"][-1] if output["op"] == "scatter" else output["args"][1]
      moved += shape_bytes(instructions[update]["type"])
    else:
      moved += shape_bytes(output["type"])
  return moved


def kernels(hlo: str) -> list[tuple[str, int]]:
  """``(kernel, bytes moved)`` of each kernel the compiled program launches, in its order."""
  computations, entry = _computations(hlo)
  instructions = _instructions(computations[entry])
  out = []
  for name, instruction in instructions.items():
    if instruction["op"] in NO_KERNEL:
      continue
    if instruction["op"] == "fusion":
      callee = re.search(r"calls=%([\w.\-]+)", instruction["line"]).group(1)
      moved = _fusion_traffic(computations[callee])
    else:  # one instruction, as a fusion of one: its operands, then it
      operands = [f"  %{a} = {instructions[a]['type']} parameter({i})"
                  for i, a in enumerate(instruction["args"]) if a in instructions]
      moved = _fusion_traffic(operands + ["  ROOT " + instruction["line"].lstrip().removeprefix(
          "ROOT ")])
    out.append((name, moved))
  return out


def traffic(hlo: str) -> int:
  """Bytes the compiled program's kernels move in all (:func:`kernels`)."""
  return sum(moved for _, moved in kernels(hlo))


def _compiled(fn, donate, *args) -> str:
  return jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text()


def _on_device(tree, device: jax.Device):
  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def programs(method: str, size: int, device: jax.Device) -> dict[str, str]:
  """The compiled compress and compress + decode of ``method`` at ``size`` elements."""
  tx = common.communication(method, None)
  grad = _on_device({"w": jax.ShapeDtypeStruct((size,), jnp.float32)}, device)
  state = _on_device(jax.eval_shape(tx.init, grad), device)
  return {"compress": _compiled(lambda g, s: tx.update(g, s)[1], 1, grad, state),
          "compress + decode": _compiled(tx.update, (0, 1), grad, state)}


def model(methods: list[tuple[str, str | None]], sizes: list[int],
          device: jax.Device) -> list[dict]:
  """Rows of the table: each method (and variant) at each size, each of its programs, and,
  after TASC's own, its pass bound (the least its compress + decode can move)."""
  rows = []
  for size in sizes:
    buffer = _on_device(jax.ShapeDtypeStruct((size,), jnp.float32), device)
    floor = traffic(_compiled(lambda e, g: e + g, (0, 1), buffer, buffer))
    bound = _compiled(compression.tasc_pass_bound, (0, 1), buffer, buffer)
    for method, variant in methods:
      with tasc.cpu_block_sums_everywhere() if variant else contextlib.nullcontext():
        compiled = programs(method, size, device)
      if method == "tasc" and not variant:
        compiled["pass bound"] = bound
      for program, hlo in compiled.items():
        launched = kernels(hlo)
        moved = sum(b for _, b in launched)
        rows.append({"elements": size, "method": method + (f" ({variant})" if variant else ""),
                     "program": program, "bytes": moved, "floor_bytes": floor,
                     "traffic_over_floor": moved / floor, "kernels": len(launched),
                     "largest": sorted(launched, key=lambda k: -k[1])[:3]})
        print(f"{size:>12,} {rows[-1]['method']:34s} {program:18s} "
              f"{moved / floor:5.2f}x the floor, {len(launched)} kernels", flush=True)
  return rows


def write(rows: list[dict], out: pathlib.Path, device: jax.Device) -> None:
  out.mkdir(parents=True, exist_ok=True)
  origin = provenance.record(devices=[device], num_workers=1, process_count=1)
  (out / "b1_traffic.json").write_text(json.dumps({"provenance": origin, "rows": rows},
                                                  indent=1) + "\n")
  lines = [f"## B1's programs compiled for one {GPU_NAME} without a GPU: modelled memory "
           "traffic / the floor's", "",
           f"Command: `{origin['command']}`  ",
           f"Commit: `{provenance.commit_text(origin)}`  ",
           f"Written {provenance.describe(origin)} (compile-only, XLA's deviceless compilation "
           "with the CUDA plugin; no GPU)", "",
           "| elements | method | program | traffic / floor | kernels | largest kernels (MB) |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    largest = ", ".join(f"{name} {moved / 1e6:.0f}" for name, moved in r["largest"])
    lines.append(f"| {r['elements']:,} | {r['method']} | {r['program']} | "
                 f"{r['traffic_over_floor']:.2f} | {r['kernels']} | {largest} |")
  lines += ["", "- Modelled, not measured: each kernel's bytes read and written in the compiled "
            "program (experiments/bench/gpu_traffic.py's docstring), over the floor's "
            "(`e + g`: two reads, one write). Launch latency, sorts' own passes and caches are "
            "not in it.",
            "- pass bound: `experiments.bench.compression.tasc_pass_bound`, the least TASC's "
            "compress + decode can move (the floor, and one write of the dense mean).",
            "- TASC (windowed block sums): the same method compiled with the CPU's form of the "
            "block sums, which TASC used on GPUs before block_sums had a GPU form."]
  (out / "b1_traffic.md").write_text("\n".join(lines) + "\n")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="benchmarks/results/gpu_model")
  parser.add_argument("--sizes", nargs="+", default=list(SIZES))
  args = parser.parse_args()
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  sizes = [common.parse_size(s) for s in args.sizes]
  methods = [("tasc", None), ("tasc", "windowed block sums")]
  device = h100()
  write(model(methods, sizes, device), pathlib.Path(args.out), device)


if __name__ == "__main__":
  main()
