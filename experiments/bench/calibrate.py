"""Measured calibration of the alpha-beta cost model on local processes.

Starts ``--processes`` CPU processes joined by ``jax.distributed`` (gloo collectives over
loopback, one device each), optionally inside a private network namespace whose loopback is
rate-limited with a token bucket (``tc ... tbf rate R``), and times

* a ping-pong (``ppermute`` from process 0 to 1 and back) per message size: half its time is
  one message, ``t = alpha + bytes * beta``, fitted by least squares (a ping-pong, as MPI
  benchmarks use, since a one-way sender could run ahead into the socket buffers; on a shaped
  link only messages of at least twice the token bucket's 512 KB burst enter the fit, as
  smaller ones pass at unshaped speed);
* a ring shift (every process sends at once) per size: the ratio of its slope to the one-way
  slope tells whether the senders share one medium (one loopback interface does);
* ``psum`` per size and one large dense all-reduce (25M float32 by default);
* a local add of two large buffers (the reduction cost ``gamma``).

It then builds the :class:`compressors.network.topology.Topology` these figures describe and reports
model against measurement. Usage::

  python -m experiments.bench.calibrate --processes 2 --rate 1gbit   # needs root for ip netns
  python -m experiments.bench.calibrate --processes 4 --rate none    # plain loopback

The namespace is deleted afterwards, also on failure; every wait is bounded by ``--timeout``.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_collections
import numpy as np

from compressors.network import collectives
from compressors.network import topology
from experiments import distributed
from experiments.bench import common

# What the measuring processes run: this module, also when it runs as the program (__main__).
MODULE = "experiments.bench.calibrate"
DEFAULT_MESSAGE_BYTES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20,
                         8 << 20, 16 << 20)
DEFAULT_ALLREDUCE_ELEMENTS = 25_000_000
TBF_BURST = "512kb"
TBF_BURST_BYTES = 512 << 10  # tc's "kb" is kilobytes
TBF_LATENCY = "100ms"
_RATE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(text: str) -> float | None:
  """Bits per second from ``"1gbit"``, ``"500mbit"``, ``"1e9"``; None for ``"none"``."""
  if text.strip().lower() == "none":
    return None
  match = re.fullmatch(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*([kmg]?)(?:bit)?\s*",
                       text.lower())
  if match is None:
    raise ValueError(f"--rate={text!r} is not a rate; allowed: e.g. 1gbit, 500mbit, 1e9, none")
  rate = float(match.group(1)) * _RATE_UNITS[match.group(2)]
  if not rate > 0:
    raise ValueError(f"--rate={text!r} must be positive")
  return rate


def netns_available() -> tuple[bool, str]:
  """Whether this process may create a network namespace and shape its loopback."""
  name = f"probe{os.getpid()}{secrets.token_hex(3)}"
  try:
    with rate_limited_namespace(1e9, name=name):
      return True, ""
  except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
    detail = getattr(e, "stderr", b"") or b""
    return False, f"ip netns / tc not permitted here: {e} {detail.decode(errors='replace')}".strip()


@contextlib.contextmanager
def rate_limited_namespace(rate_bits: float, *, name: str | None = None) -> Iterator[str]:
  """A fresh network namespace whose loopback is limited to ``rate_bits`` bits/s.

  Yields its name; deletes it on exit, also when the body fails.
  """
  name = name or f"calib{os.getpid()}{secrets.token_hex(3)}"
  subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=30)
  try:
    for cmd in (["ip", "-n", name, "link", "set", "lo", "up"],
                ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                 "rate", f"{int(rate_bits)}bit", "burst", TBF_BURST, "latency", TBF_LATENCY]):
      subprocess.run(cmd, check=True, capture_output=True, timeout=30)
    yield name
  finally:
    subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True, timeout=30)


def fit_alpha_beta(message_bytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
  """Ordinary least-squares fit of ``t = alpha + bytes * beta``.

  Absolute (not relative) error, so the large messages, whose times the link sets, fix
  ``beta``; small-message times on a loaded host are mostly scheduling noise and would bias a
  relative fit. ``alpha`` is the intercept.

  Returns:
    ``(alpha, beta)`` in seconds and seconds per byte.

  Raises:
    ValueError: fewer than two distinct sizes, or a fit with no positive ``beta``.
  """
  s, t = np.asarray(message_bytes, float), np.asarray(seconds, float)
  if s.size != t.size or np.unique(s).size < 2:
    raise ValueError(f"fit_alpha_beta: need times for at least two distinct sizes, got sizes "
                     f"{list(s)} and {t.size} times")
  beta, alpha = np.polyfit(s, t, 1)
  if not beta > 0:
    raise ValueError(f"fit_alpha_beta: the fitted beta={beta:.3g} s/B is not positive: the "
                     f"times {list(t)} do not grow with the sizes {list(s)}; time larger messages")
  return float(alpha), float(beta)


def _repeats(message_bytes: int) -> int:
  """Calls per timing: more for small messages, whose times are noisy; the same on every
  process (each call is a collective). The fastest call is kept: other load on the host only
  ever adds time."""
  return int(np.clip((32 << 20) // max(message_bytes, 1), 3, 20))


@dataclasses.dataclass
class Calibration:
  """Measured times (fastest call, slowest process) and the fitted model.

  Attributes:
    processes: number of processes (devices).
    rate_bits: the configured loopback rate in bits/s, or None (unshaped).
    message_bytes: sizes timed.
    measured: kind (``pingpong``, ``shift``, ``psum``) -> seconds per size.
    allreduce_elements: float32 elements of the large all-reduce.
    allreduce_seconds: its measured time.
    alpha: fitted latency, seconds.
    beta: fitted seconds per byte.
    gamma: measured local reduction, seconds per byte.
    concurrency: ring-shift slope over one-way slope (about ``p`` on a shared medium).
    shared: whether the model treats the link as one shared medium.
    predicted: kind -> model seconds per size, and ``allreduce`` -> model seconds.
  """
  processes: int
  rate_bits: float | None
  message_bytes: list[int]
  measured: dict[str, list[float]]
  allreduce_elements: int
  allreduce_seconds: float
  alpha: float
  beta: float
  gamma: float
  concurrency: float
  shared: bool
  predicted: dict

  @property
  def fitted_rate_bits(self) -> float:
    return 8 / self.beta

  @property
  def allreduce_error(self) -> float:
    """Relative error of the model on the large all-reduce."""
    return self.predicted["allreduce"] / self.allreduce_seconds - 1

  def topology(self):
    """The fitted loopback as a :class:`compressors.network.topology.Topology` (a negative fitted
    ``alpha`` counts as 0)."""
    return _loopback(self.processes, self.alpha, self.beta, self.gamma, self.shared)

  def __str__(self):
    configured = (f"{self.rate_bits / 1e9:.4g} Gbit/s configured" if self.rate_bits else
                  "unshaped")
    rows = [f"calibration over {self.processes} processes ({configured})",
            f"  alpha {self.alpha * 1e6:.1f} us (intercept; the model uses max(alpha, 0)), "
            f"beta {self.beta * 1e9:.4g} ns/B = {self.fitted_rate_bits / 1e9:.4g} Gbit/s, "
            f"gamma {self.gamma * 1e12:.1f} ps/B",
            f"  ring shift / one-way slope: {self.concurrency:.2f} -> "
            f"{'shared medium' if self.shared else 'independent links'}",
            f"  {'bytes':>10}" + "".join(f"{k + ' meas':>16}{k + ' model':>16}"
                                         for k in self.measured)]
    for i, size in enumerate(self.message_bytes):
      rows.append(f"  {size:>10}" + "".join(
          f"{self.measured[k][i] * 1e3:>13.3f} ms{self.predicted[k][i] * 1e3:>13.3f} ms"
          for k in self.measured))
    rows.append(f"  all-reduce of {self.allreduce_elements} float32: measured "
                f"{self.allreduce_seconds:.4f} s, model {self.predicted['allreduce']:.4f} s "
                f"({self.allreduce_error:+.1%})")
    if self.rate_bits:
      rows.append(f"  fitted rate / configured: {self.fitted_rate_bits / self.rate_bits:.3f}")
    return "\n".join(rows)


def calibrate(processes: int = 2, rate_bits: float | None = 1e9, *,
              message_bytes: Sequence[int] = DEFAULT_MESSAGE_BYTES,
              allreduce_elements: int = DEFAULT_ALLREDUCE_ELEMENTS,
              timeout_s: float = 600.0) -> Calibration:
  """Runs the measurement processes and fits the model.

  Args:
    processes: 2 to 8 local processes, one CPU device each.
    rate_bits: loopback rate in bits/s inside a private namespace; None for the host loopback.
    message_bytes: sizes to time (multiples of 4; at least two distinct ones, of 1 MiB or more
      on a shaped link, enter the fit).
    allreduce_elements: float32 elements of the large all-reduce to predict.
    timeout_s: bound on the whole run; the processes are killed after it.

  Returns:
    The :class:`Calibration`.

  Raises:
    ValueError: bad arguments.
    RuntimeError: a process failed or the run timed out (with its log's tail).
  """
  if not isinstance(processes, int) or not 2 <= processes <= 8:
    raise ValueError(f"calibrate: processes={processes!r}; allowed: an int from 2 to 8")
  sizes = sorted(set(int(s) for s in message_bytes))
  if len(_fitted(sizes, rate_bits)) < 2 or any(s < 4 or s % 4 for s in sizes):
    raise ValueError(f"calibrate: message_bytes={list(message_bytes)}; allowed: positive "
                     f"multiples of 4, at least two distinct ones of {2 * TBF_BURST_BYTES} bytes "
                     "or more on a shaped link (smaller ones pass within the token bucket's "
                     "burst)")
  if allreduce_elements < 1:
    raise ValueError(f"calibrate: allreduce_elements={allreduce_elements} must be >= 1")
  with contextlib.ExitStack() as stack:
    prefix = []
    if rate_bits is not None:
      prefix = ["ip", "netns", "exec", stack.enter_context(rate_limited_namespace(rate_bits))]
    results = _run_workers(prefix, processes, sizes, allreduce_elements, timeout_s)
  return _fit(processes, rate_bits, sizes, allreduce_elements, results)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_workers(prefix: list[str], processes: int, sizes: list[int], allreduce_elements: int,
                 timeout_s: float) -> list[dict]:
  env = common.cpu_env(1)
  port = _free_port()
  with tempfile.TemporaryDirectory(prefix="calibrate") as tmp:
    workers = []
    try:
      for i in range(processes):
        cmd = prefix + [sys.executable, "-m", MODULE, "--worker", str(i),
                        "--processes", str(processes), "--port", str(port),
                        "--message-bytes", *map(str, sizes),
                        "--allreduce-elements", str(allreduce_elements),
                        "--out", f"{tmp}/worker{i}.json"]
        log = open(f"{tmp}/worker{i}.log", "wb")  # pylint: disable=consider-using-with
        workers.append((subprocess.Popen(cmd, cwd=common.REPO_ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT), log))
      deadline = time.monotonic() + timeout_s
      for i, (proc, _) in enumerate(workers):
        try:
          code = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
          code = None
        if code != 0:
          tail = Path(f"{tmp}/worker{i}.log").read_text(errors="replace")[-3000:]
          why = f"timed out after {timeout_s} s" if code is None else f"exited with {code}"
          raise RuntimeError(f"calibrate: worker {i} {why}; its log ends:\n{tail}")
      return [json.loads(Path(f"{tmp}/worker{i}.json").read_text()) for i in range(processes)]
    finally:
      for proc, log in workers:
        if proc.poll() is None:
          proc.kill()
          proc.wait(timeout=30)
        log.close()


def _fitted(sizes: list[int], rate_bits: float | None) -> list[int]:
  """Positions of the sizes that enter the fit: on a shaped link, those of at least twice the
  token bucket's burst (smaller messages pass at unshaped speed)."""
  return [i for i, s in enumerate(sizes) if rate_bits is None or s >= 2 * TBF_BURST_BYTES]


def _fit(processes: int, rate_bits: float | None, sizes: list[int], allreduce_elements: int,
         results: list[dict]) -> Calibration:
  measured = {kind: [max(r[kind][i] for r in results) for i in range(len(sizes))]
              for kind in ("pingpong", "shift", "psum")}
  fit = _fitted(sizes, rate_bits)
  alpha, beta = fit_alpha_beta([sizes[i] for i in fit],
                               [measured["pingpong"][i] / 2 for i in fit])
  concurrency = fit_alpha_beta([sizes[i] for i in fit],
                               [measured["shift"][i] for i in fit])[1] / beta
  shared = concurrency > (1 + processes) / 2
  gamma = results[0]["gamma"]
  topo = _loopback(processes, alpha, beta, gamma, shared)
  steps = lambda s, *pairs: topology.steps_cost([collectives.Step(p, s) for p in pairs],
                                                topo).time
  psum = lambda n: topology.dense_cost("psum", topo, n, 4).time
  predicted = {"pingpong": [steps(s, ((0, 1),), ((1, 0),)) for s in sizes],
               "shift": [steps(s, collectives.ring_pairs(processes)) for s in sizes],
               "psum": [psum(s // 4) for s in sizes], "allreduce": psum(allreduce_elements)}
  return Calibration(
      processes=processes, rate_bits=rate_bits, message_bytes=sizes, measured=measured,
      allreduce_elements=allreduce_elements,
      allreduce_seconds=max(r["allreduce"] for r in results), alpha=alpha, beta=beta,
      gamma=gamma, concurrency=concurrency, shared=shared, predicted=predicted)


def _loopback(processes: int, alpha: float, beta: float, gamma: float, shared: bool):
  link = topology.Link(alpha=max(alpha, 0.0), bandwidth=1 / beta, gamma=gamma,
                       name="fitted loopback")
  return topology.Topology.flat(processes, link, shared=shared, name=f"loopback x{processes}")


# ----------------------------------------------------------------------------- worker


def _worker(args) -> None:
  """One measuring process: joins the job, times every collective, writes JSON."""
  config = ml_collections.ConfigDict({
      "num_devices": args.processes,
      "distributed": {"coordinator_address": f"127.0.0.1:{args.port}",
                      "num_processes": args.processes, "process_id": args.worker}})
  distributed.expose_cpu_devices(config)
  distributed.initialize(config)

  p = jax.process_count()
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
  sharding = NamedSharding(mesh, P("x"))

  def collective(body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

  programs = {
      "pingpong": collective(lambda a: jax.lax.ppermute(
          jax.lax.ppermute(a, "x", ((0, 1),)), "x", ((1, 0),))),
      "shift": collective(lambda a: jax.lax.ppermute(a, "x", collectives.ring_pairs(p))),
      "psum": collective(lambda a: jax.lax.psum(a, "x")),
  }

  def seconds_per_call(kind: str, elements: int, repeats: int) -> float:
    program = programs[kind]
    local = np.full((1, elements), args.worker + 1, np.float32)
    x = jax.make_array_from_process_local_data(sharding, local)
    program(x).block_until_ready()  # compile
    multihost_utils.sync_global_devices(f"{kind} {elements}")
    program(x).block_until_ready()  # drain the token bucket that filled while waiting
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      program(x).block_until_ready()
      times.append(time.perf_counter() - start)
    return min(times)

  out = {kind: [seconds_per_call(kind, s // 4, _repeats(s)) for s in args.message_bytes]
         for kind in programs}
  out["allreduce"] = seconds_per_call("psum", args.allreduce_elements, 3)
  add = jax.jit(jnp.add)
  a = jnp.ones((args.allreduce_elements,), jnp.float32)
  add(a, a).block_until_ready()
  times = []
  for _ in range(5):
    start = time.perf_counter()
    add(a, a).block_until_ready()
    times.append(time.perf_counter() - start)
  out["gamma"] = min(times) / a.nbytes
  Path(args.out).write_text(json.dumps(out))
  multihost_utils.sync_global_devices("done")
  jax.distributed.shutdown()


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                   description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--rate", default="1gbit",
                      help="loopback rate inside a private namespace (e.g. 1gbit), or none")
  parser.add_argument("--message-bytes", type=int, nargs="+", default=DEFAULT_MESSAGE_BYTES)
  parser.add_argument("--allreduce-elements", type=int, default=DEFAULT_ALLREDUCE_ELEMENTS)
  parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
  parser.add_argument("--json", help="also write the figures to this file")
  parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--out", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker is not None:
    _worker(args)
    return
  result = calibrate(args.processes, parse_rate(args.rate), message_bytes=args.message_bytes,
                     allreduce_elements=args.allreduce_elements, timeout_s=args.timeout)
  print(result)
  print(result.topology())
  if args.json:
    Path(args.json).write_text(json.dumps(
        dataclasses.asdict(result) | {"fitted_rate_bits": result.fitted_rate_bits,
                                      "allreduce_error": result.allreduce_error}, indent=1))


if __name__ == "__main__":
  main()
