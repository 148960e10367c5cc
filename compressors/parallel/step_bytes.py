"""The bytes of a data-parallel step, read from its compiled programs (compiled, never run).

:func:`wire_bytes` reads one step kind's program (with several simulated workers per device,
the program of the same step with one worker per device: its collectives are the real ones);
:func:`bytes_per_step` charges each step its kind's bytes; :func:`nonfinite_flag_bytes` and
:func:`replica_check_bytes` price the non-finite skip's flag and one replica check;
:func:`peak_bytes_per_device` reads the memory a device holds while it runs a step. Each takes a
:class:`compressors.DataParallel` (``dp``); its methods of the same names call these.
"""

from typing import Any

import chex
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from compressors.parallel import hlo_bytes
from compressors.parallel import nonfinite
from compressors.parallel import step_kinds as kinds_lib
from compressors.parallel.train_state import TrainState


def abstract(tree: chex.ArrayTree, mesh: jax.sharding.Mesh,
             specs: chex.ArrayTree) -> chex.ArrayTree:
  """Shapes and dtypes of ``tree``, sharded on ``mesh`` by ``specs`` (a spec or a tree)."""
  specs = jax.tree.broadcast(specs, tree, is_leaf=lambda s: isinstance(s, P))
  return jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(
      jax.numpy.shape(x), jax.numpy.result_type(x), sharding=NamedSharding(mesh, spec)),
      tree, specs, is_leaf=lambda s: isinstance(s, P))


def wire_bytes(dp: Any, params: chex.ArrayTree, state: chex.ArrayTree, batch: chex.ArrayTree, *,
               kind: str | None = None,
               model_state: chex.ArrayTree = ()) -> hlo_bytes.WireBytes:
  """Bytes one worker sends in a step of ``kind`` (None: the every-step kind), read from its
  compiled program (compiled, never run): with several workers per device, from the program of
  one worker per device. ``params``, ``state``, ``batch`` and ``model_state`` may be abstract
  (shapes, dtypes)."""
  kind = kind or kinds_lib.steady(tuple(dp.kinds.values()))
  if dp.workers is not None and dp.workers.per_device > 1:
    one_each = dp.equivalent()
    shapes = lambda tree, specs: abstract(tree, one_each.mesh, specs)
    return wire_bytes(one_each, shapes(params, one_each.params_spec),
                      shapes(state, one_each.specs), shapes(batch, one_each.workers.spec),
                      kind=kind, model_state=shapes(model_state, one_each.workers.spec))
  # The steps' own lower (not a jit around them): a wrapped step still compiles the real one.
  if dp.train_step is None:  # pmap
    return hlo_bytes.wire_bytes(dp.step, params, state, batch, kind=kind)
  state, batch = _laid_out(dp, params, state, batch, model_state)
  return hlo_bytes.wire_bytes(dp.train_step, state, batch, kind=kind, mesh=dp.mesh)


def _laid_out(dp: Any, params, state, batch, model_state) -> tuple[TrainState, chex.ArrayTree]:
  """The train step's arguments' shapes, laid out on ``dp``'s mesh as the step takes them."""
  state = TrainState(abstract(jnp.zeros((), jnp.int32), dp.mesh, P()),
                     abstract(params, dp.mesh, dp.params_spec),
                     abstract(model_state, dp.mesh, dp.workers.spec),
                     abstract(state, dp.mesh, dp.specs))
  return state, abstract(batch, dp.mesh, dp.workers.spec)


def peak_bytes_per_device(dp: Any, params: chex.ArrayTree, state: chex.ArrayTree,
                          batch: chex.ArrayTree, *, kind: str | None = None,
                          model_state: chex.ArrayTree = ()) -> int | None:
  """The most bytes one device holds while it runs a train step of ``kind`` (None: the
  every-step kind), from the compiled program's memory analysis (compiled, never run): its
  arguments (parameters, optimizer and model state, batch) + its outputs + its temporaries
  (gradients, activations, gathered parameters) - the outputs written into donated arguments.
  An upper bound: the compiler's buffers, counted as if all were live at once. None where the
  backend gives no analysis. Needs a mesh; the arguments may be abstract."""
  kind = kind or kinds_lib.steady(tuple(dp.kinds.values()))
  state, batch = _laid_out(dp, params, state, batch, model_state)
  stats = dp.train_step.lower(state, batch, kind=kind).compile().memory_analysis()
  if stats is None:
    return None
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
          - stats.alias_size_in_bytes)


def bytes_per_step(dp: Any, per_kind: dict[str, float], start: int, stop: int) -> float:
  """Mean bytes per step over the steps ``start, ..., stop - 1``, each step charged the bytes
  of its kind (``per_kind``: :func:`wire_bytes` totals by kind name; a kind that runs at none
  of these steps may be missing)."""
  counts = dp.kind_counts(start, stop)
  return sum(per_kind[k] * n for k, n in counts.items() if n) / max(1, stop - start)


def _one_worker_per_device(dp: Any) -> Any:
  return dp.equivalent() if dp.workers.per_device > 1 else dp


def nonfinite_flag_bytes(dp: Any) -> float:
  """Bytes per worker of the non-finite skip's flag, a part of every step (compiled alone, for
  one worker per device: it does not depend on the gradient)."""
  layout = _one_worker_per_device(dp).workers
  guard = nonfinite.skip_nonfinite(optax.identity(), axis_name=layout.worker_axes)
  flag_only = jax.shard_map(lambda g: guard.update(g[0], guard.init(g[0]))[1].skipped[None],
                            mesh=layout.mesh, in_specs=layout.spec, out_specs=layout.spec)
  return hlo_bytes.wire_bytes(flag_only,
                              jax.ShapeDtypeStruct((layout.count,), jnp.float32)).total


def replica_check_bytes(dp: Any, params: chex.ArrayTree) -> float:
  """Bytes per worker of one replica check (``dp.replicas_agree``), compiled for one worker per
  device; ``params`` may be abstract."""
  one_each = _one_worker_per_device(dp)
  return hlo_bytes.wire_bytes(one_each.replicas_agree,
                              abstract(params, one_each.mesh, one_each.params_spec)).total
