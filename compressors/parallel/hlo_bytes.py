"""Bytes on the wire, read from the compiled program.

:func:`wire_bytes` is the project's single source of truth for "bytes on the wire": it compiles
the function, reads every collective in the compiled HLO, and charges each with the bytes one
device sends under the bandwidth-optimal algorithm for it (Thakur, Rabenseifner & Gropp 2005):

==================  ===========================================  =========================
collective          ``S`` (from the compiled op)                 bytes one device sends
==================  ===========================================  =========================
all-reduce          operand size                                 ``2 (n-1)/n * S``
all-gather          gathered (output) size                       ``(n-1)/n * S``
reduce-scatter      input size (output size times ``n``)         ``(n-1)/n * S``
all-to-all          operand size                                 ``(n-1)/n * S``
collective-permute  operand size                                 ``S`` times the fraction
                                                                 of devices that send
==================  ===========================================  =========================

``n`` is the size of the op's replica group. Because the compiled program is read, what XLA
really moves is what is charged: a masked dense ``psum`` is charged as dense, and a bf16
all-reduce that the CPU backend widens to f32 is charged at 4 bytes an element.

Control flow: collectives in a ``while`` body are charged once per iteration when XLA knows the
trip count (``known_trip_count``; otherwise once, and the report says so); a ``conditional`` is
charged at its most expensive branch (a worst case: every step pays at most that).
"""

import collections
import dataclasses
import math
import re
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.extend
import numpy as np

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e3m4": 1, "f8e4m3b11fnuz": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the compiled program.

  Attributes:
    kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all`` or
      ``collective-permute``.
    dtypes: element types of its operands (after any widening XLA did).
    size_bytes: ``S`` of the table in the module docstring.
    group_size: devices per replica group (``n``).
    axes: mesh axes its groups span (names), or ``("group of n",)`` without a mesh.
    executions: how many times it runs per call (loop trip counts).
    bytes_per_device: bytes one device sends per call, all executions included.
  """
  kind: str
  dtypes: tuple[str, ...]
  size_bytes: float
  group_size: int
  axes: tuple[Hashable, ...]
  executions: int
  bytes_per_device: float


@dataclasses.dataclass(frozen=True)
class WireBytes:
  """Bytes one device sends per call of a compiled function.

  Attributes:
    total: all collectives together.
    by_kind: total per collective kind.
    by_axis: total per mesh-axis group (a tuple of axis names: the axes the op's groups span).
    collectives: every collective, in program order.
    unknown_trip_counts: collectives inside loops whose trip count XLA did not know (charged
      once each).
  """
  total: float
  by_kind: dict[str, float]
  by_axis: dict[tuple[Hashable, ...], float]
  collectives: tuple[Collective, ...]
  unknown_trip_counts: int = 0

  def __str__(self) -> str:
    lines = [f"{'kind':<20}{'axes':<22}{'n':>4}{'runs':>6}{'S (bytes)':>14}{'sent/device':>16}"]
    for c in self.collectives:
      lines.append(f"{c.kind:<20}{'+'.join(map(str, c.axes)):<22}{c.group_size:>4}"
                   f"{c.executions:>6}{c.size_bytes:>14,.0f}{c.bytes_per_device:>16,.0f}")
    lines.append(f"{'total':<62}{self.total:>16,.0f}")
    return "\n".join(lines)


def wire_bytes(fn: Callable[..., Any], *args, mesh: jax.sharding.Mesh | None = None,
               **kwargs) -> WireBytes:
  """Bytes one device sends when ``fn(*args, **kwargs)`` runs, from its compiled HLO.

  Args:
    fn: a function, a ``jax.jit``-ed function or a ``jax.pmap``-ed function. Only lowered and
      compiled, never run, so ``args`` may be ``jax.ShapeDtypeStruct``s (abstract shapes).
    *args: its positional arguments.
    mesh: the mesh, to name the axes each collective spans; by default taken from the compiled
      input shardings when they carry one.
    **kwargs: its keyword arguments.

  Returns:
    A :class:`WireBytes` with the total and its breakdown by kind and by mesh axis.
  """
  lowerable = fn if hasattr(fn, "lower") else jax.jit(fn)
  compiled = lowerable.lower(*args, **kwargs).compile()
  if mesh is None:
    mesh = _mesh_of(compiled) or _shard_map_mesh(fn, args, kwargs)
  return parse_hlo(compiled.as_text(), mesh)


def parse_hlo(text: str, mesh: jax.sharding.Mesh | None = None) -> WireBytes:
  """The :class:`WireBytes` of compiled HLO text (see :func:`wire_bytes`)."""
  computations, entry = _split_computations(text)
  num_devices = _num_devices(text)
  unknown = [0]
  found = _collectives_of(entry, computations, num_devices, mesh, 1, unknown)
  by_kind, by_axis = collections.defaultdict(float), collections.defaultdict(float)
  for c in found:
    by_kind[c.kind] += c.bytes_per_device
    by_axis[c.axes] += c.bytes_per_device
  return WireBytes(total=sum(c.bytes_per_device for c in found), by_kind=dict(by_kind),
                   by_axis=dict(by_axis), collectives=tuple(found),
                   unknown_trip_counts=unknown[0])


def _mesh_of(compiled) -> jax.sharding.Mesh | None:
  try:
    shardings = jax.tree.leaves(compiled.input_shardings)
  except Exception:  # pylint: disable=broad-except  # pmap executables have none
    return None
  for s in shardings:
    mesh = getattr(s, "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh) and mesh.size > 1:
      return mesh
  return None


def _shard_map_mesh(fn, args, kwargs) -> jax.sharding.Mesh | None:
  """The mesh of the first ``shard_map`` in ``fn``'s jaxpr (inputs may all be replicated)."""
  try:
    jaxpr = jax.make_jaxpr(fn)(*args, **kwargs).jaxpr
  except Exception:  # pylint: disable=broad-except  # e.g. pmap-ed functions
    return None
  stack = [jaxpr]
  while stack:
    for eqn in stack.pop().eqns:
      mesh = eqn.params.get("mesh")
      if isinstance(mesh, jax.sharding.Mesh):
        return mesh
      stack += [v.jaxpr if hasattr(v, "jaxpr") else v for v in eqn.params.values()
                if isinstance(v, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr))]
  return None


def _split_computations(text: str) -> tuple[dict[str, list[str]], str]:
  computations, entry, current = {}, None, None
  for line in text.splitlines():
    match = _COMPUTATION.match(line.strip()) if not line.startswith(" ") else None
    if match:
      current = match.group(1)
      computations[current] = []
      if line.lstrip().startswith("ENTRY"):
        entry = current
    elif current is not None and line.strip() == "}":
      current = None
    elif current is not None:
      computations[current].append(line)
  if entry is None:
    raise ValueError("wire_bytes: no ENTRY computation in the compiled HLO text")
  return computations, entry


def _num_devices(text: str) -> int:
  header = text.split("\n", 1)[0]
  partitions = re.search(r"num_partitions=(\d+)", header)
  replicas = re.search(r"replica_count=(\d+)", header)
  return (int(partitions.group(1)) if partitions else 1) * (int(replicas.group(1)) if replicas
                                                          else 1)


def _collectives_of(name, computations, num_devices, mesh, executions, unknown):
  found = []
  for line in computations.get(name, ()):
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    instruction, shape, opcode, rest = match.groups()
    base_op = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
    if base_op in _KINDS:
      found.append(_collective(base_op, opcode != base_op, shape, rest, num_devices, mesh,
                               executions, f"%{instruction} ({opcode})"))
    elif opcode == "while":
      body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
      trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
      if trips is None:
        unknown[0] += len(_collectives_of(body, computations, num_devices, mesh, 1, [0]))
      count = int(trips.group(1)) if trips else 1
      found += _collectives_of(body, computations, num_devices, mesh, executions * count,
                               unknown)
    elif opcode == "conditional":
      branches = re.findall(r"%?([\w.\-]+)", _branch_list(rest))
      options = [_collectives_of(b, computations, num_devices, mesh, executions, unknown)
                 for b in branches]
      found += max(options, key=lambda cs: sum(c.bytes_per_device for c in cs), default=[])
    else:
      for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", rest):
        found += _collectives_of(callee, computations, num_devices, mesh, executions, unknown)
  return found


def _branch_list(rest: str) -> str:
  listed = re.search(r"branch_computations=\{([^}]*)\}", rest)
  if listed:
    return listed.group(1)
  pair = re.search(r"true_computation=%?([\w.\-]+),\s*false_computation=%?([\w.\-]+)", rest)
  return f"{pair.group(1)} {pair.group(2)}" if pair else ""


def _arrays(shape: str) -> list[tuple[str, float]]:
  """(dtype, bytes) of every array in an HLO shape (one array or a tuple)."""
  out = []
  for dtype, dims in _ARRAY.findall(shape):
    if dtype not in _DTYPE_BYTES:
      continue
    elements = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    out.append((dtype, elements * _DTYPE_BYTES[dtype]))
  return out


def _collective(kind, is_async, shape, rest, num_devices, mesh, executions,
                instruction) -> Collective:
  arrays = _arrays(shape)
  if is_async and kind == "all-gather":
    arrays = arrays[len(arrays) // 2:]  # (operands..., outputs...)
  elif is_async and kind == "collective-permute":
    arrays = arrays[:1]  # (operand, output, contexts...)
  result_bytes = sum(b for _, b in arrays)
  dtypes = tuple(d for d, _ in arrays)

  if kind == "collective-permute":
    pairs = [tuple(int(v) for v in p.split(","))
             for p in re.findall(r"\{(\d+,\d+)\}", _field(rest, "source_target_pairs"))]
    groups = [list(p) for p in pairs]
    senders = len({a for a, b in pairs if a != b})
    group_size = 2 if pairs else 1
    per_device = result_bytes * senders / max(num_devices, 1)
    size = result_bytes
  else:
    groups = _replica_groups(rest, num_devices, instruction)
    n = len(groups[0]) if groups else num_devices
    group_size = n
    size = result_bytes * n if kind == "reduce-scatter" else result_bytes
    factor = {"all-reduce": 2.0 * (n - 1) / n}.get(kind, (n - 1) / n) if n > 1 else 0.0
    per_device = factor * size
  return Collective(kind=kind, dtypes=dtypes, size_bytes=size, group_size=group_size,
                    axes=_axes_spanned(groups, mesh, group_size), executions=executions,
                    bytes_per_device=per_device * executions)


def _field(rest: str, name: str) -> str:
  """The balanced-brace value of ``name={...}`` in an instruction's attribute list."""
  start = rest.find(name + "={")
  if start < 0:
    return ""
  i, depth = start + len(name) + 1, 0
  for j in range(i, len(rest)):
    depth += {"{": 1, "}": -1}.get(rest[j], 0)
    if depth == 0:
      return rest[i:j + 1]
  return rest[i:]


def _replica_groups(rest: str, num_devices: int, instruction: str) -> list[list[int]]:
  """The replica groups of a collective, as lists of device ids, in any form XLA prints.

  * listed: ``replica_groups={{0,1},{2,3}}`` (every JAX; ``{}`` means all devices);
  * iota: ``replica_groups=[2,4]<=[4,2]T(1,0)``;
  * mesh axes (XLA of JAX 0.11 and later): ``replica_groups=mesh['a'=2,'b'=4] {'b'}``, with an
    optional ``, device_ids=(...)`` after the mesh and sub-axes written ``'a':(pre)size``.
  """
  if re.search(r"replica_groups=(maximal_)?mesh\[", rest):
    return _mesh_axes_groups(rest, instruction)
  iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
  if iota:
    group_shape = [int(v) for v in iota.group(1).split(",")]
    return _iota(iota.group(2), iota.group(3)).reshape(group_shape[0], -1).tolist()
  if "replica_groups=" in rest and not rest.split("replica_groups=", 1)[1].startswith("{"):
    raise ValueError(f"wire_bytes: cannot read the replica groups of {instruction}: "
                     f"{rest.split('replica_groups=', 1)[1][:120]!r} is in no form this parser "
                     "knows (listed, iota or mesh axes)")
  listed = _field(rest, "replica_groups")
  groups = [[int(v) for v in g.split(",") if v] for g in re.findall(r"\{([\d,]*)\}", listed)]
  groups = [g for g in groups if g]
  return groups or [list(range(num_devices))]


def _iota(dims: str, perm: str | None) -> np.ndarray:
  """``iota(prod(dims)).reshape(dims).transpose(perm)``, as XLA's ``[..]<=[dims]T(perm)``."""
  shape = [int(v) for v in dims.split(",")]
  ids = np.arange(math.prod(shape)).reshape(shape)
  return ids.transpose([int(v) for v in perm.split(",")]) if perm else ids


_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?P<ids>[^)]*(?:\([^)]*\))?[^)]*)\))?\s*\{(?P<grouped>[^}]*)\}")
_MESH_AXIS = re.compile(r"'?([^'=,]+)'?=(\d+)")
_AXIS_REF = re.compile(r"^'?([^':]+)'?(?::\((\d+)\)(\d+))?$")


def _mesh_axes_groups(rest: str, instruction: str) -> list[list[int]]:
  """Replica groups of XLA's mesh-axes form: the devices that differ only along the named axes.

  As XLA's ``MeshAxesReplicaGroupList``: each mesh axis is split into the sub-axes the groups
  name (a sub-axis ``a:(pre)size`` is the middle factor of ``a = pre x size x rest``, major to
  minor), the grouped factors are moved last in the order named, and consecutive runs of the
  device assignment form the groups.
  """
  match = _MESH_GROUPS.search(rest)
  if match is None:
    if re.search(r"replica_groups=maximal_mesh\[", rest):
      return [[int(re.search(r"device_id=(\d+)", rest).group(1))]]
    raise ValueError(f"wire_bytes: cannot read the mesh-axes replica groups of {instruction}: "
                     f"{rest.split('replica_groups=', 1)[-1][:160]!r}")
  names, sizes = zip(*[(n.strip(), int(s)) for n, s in _MESH_AXIS.findall(match.group("axes"))])
  devices = _device_assignment(match.group("ids"), sizes, instruction)
  refs = []
  for text in filter(None, (t.strip() for t in match.group("grouped").split(","))):
    ref = _AXIS_REF.match(text)
    if ref is None or ref.group(1) not in names:
      raise ValueError(f"wire_bytes: {instruction} groups over {text!r}, which names no axis of "
                       f"its mesh {list(names)}")
    axis = names.index(ref.group(1))
    pre, size = (int(ref.group(2)), int(ref.group(3))) if ref.group(2) else (1, sizes[axis])
    refs.append((axis, pre, size))
  # Factor each mesh axis at the boundaries its sub-axes name (major to minor).
  factors, position = [], {}
  for axis, full in enumerate(sizes):
    bounds = sorted({1, full} | {b for a, pre, size in refs if a == axis
                                 for b in (pre, pre * size)})
    for lo, hi in zip(bounds[:-1], bounds[1:]) if full > 1 else [(1, 1)]:  # a size-1 axis too
      position[(axis, lo)] = len(factors)
      factors.append(hi // lo)
  grouped = [position[(axis, pre)] for axis, pre, _ in refs]
  order = [f for f in range(len(factors)) if f not in grouped] + grouped
  group_size = math.prod(factors[f] for f in grouped)
  return devices.reshape(factors).transpose(order).reshape(-1, group_size).tolist()


def _device_assignment(ids: str | None, sizes: tuple[int, ...], instruction: str) -> np.ndarray:
  """The mesh's device ids: iota unless ``device_ids=(...)`` gives an iota form or a list."""
  count = math.prod(sizes)
  if ids is None:
    return np.arange(count)
  iota = re.search(r"<=\[([\d,]+)\](?:T\(([\d,]+)\))?", ids)
  if iota:
    devices = _iota(iota.group(1), iota.group(2)).reshape(-1)
  else:
    devices = np.array([int(v) for v in re.sub(r"^\s*(devices=)?\[[\d,]*\]", "", ids).split(",")
                        if v.strip()])
  if devices.size != count:
    raise ValueError(f"wire_bytes: {instruction}'s mesh has {count} devices but its device_ids "
                     f"({ids!r}) list {devices.size}")
  return devices


def _axes_spanned(groups, mesh, group_size) -> tuple[Hashable, ...]:
  if group_size <= 1:
    return ()
  if mesh is None or not groups or max(max(g) for g in groups) >= mesh.size:
    return (f"group of {group_size}",)
  coords = [np.array(np.unravel_index(g, mesh.devices.shape)) for g in groups]
  spanned = [name for axis, name in enumerate(mesh.axis_names)
             if any(len(set(c[axis].tolist())) > 1 for c in coords)]
  return tuple(spanned)
