r"""Large-batch training on MNIST-1D: SGD(momentum), Adam, LARS and LAMB at growing batch sizes.

A small MLP is trained for a fixed number of epochs (so larger batches take fewer steps) with
each optimizer's learning rate tuned once at ``BASE_BATCH_SIZE`` and moved to other batch sizes
by the usual rule: linear for SGD and LARS (Goyal et al. 2017; You et al. 2017), square root for
Adam and LAMB (You et al. 2020). Every run warms up for ``WARMUP_FRACTION`` of its steps, then
decays polynomially: power 2 for LARS (MLPerf), power 1 for the others (the LAMB/BERT recipe).

MNIST-1D (Greydanus 2020) is generated offline by the ``mnist1d`` package; the default
``num_samples=20000`` (16000 train / 4000 test, instead of the package's 5000) keeps several
steps per epoch at batch 4096. The generated arrays are cached in the output folder.

Usage::

  python -m experiments.large_batch --epochs=30 --batch_sizes=128,512,4096 --seeds=0,1

Writes ``results.md`` (a table: test accuracy per batch size and optimizer) and
``results.json`` (every run) to ``--out`` (default ``runs/large_batch``).
"""

from collections.abc import Callable, Sequence
import functools
import json
import os
import time
from typing import Any, NamedTuple

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from optimizers import lamb
from optimizers import lars
from optimizers import scale_learning_rate
from optimizers import warmup_polynomial_decay

BASE_BATCH_SIZE = 128
WARMUP_FRACTION = 0.1
HIDDEN_WIDTHS = (128, 128)
NUM_CLASSES = 10


class Recipe(NamedTuple):
  """How one optimizer is run: its learning rate at ``BASE_BATCH_SIZE`` and how it scales."""
  base_learning_rate: float
  scaling_rule: str  # "linear" or "sqrt", see optimizers.scale_learning_rate
  decay_power: float
  make: Callable[[optax.Schedule], optax.GradientTransformation]
  description: str


# Base learning rates from a coarse sweep at batch 128, 30 epochs, seed 0 (test accuracy):
#   sgd  0.05/0.1/0.2: 81.1/84.3/86.3      adam 2e-3/5e-3/1e-2: 78.7/82.5/84.4
#   lars 1/3/10:       74.0/84.5/88.8      lamb 1e-2/2e-2/5e-2: 86.1/85.9/53.0
# SGD, Adam and LARS were best at the grid's upper edge; they take the middle value (2-4 points
# below it at batch 128). LAMB takes its best, 1e-2. No rate was chosen by a large-batch result.
RECIPES = {
    "sgd": Recipe(0.1, "linear", 1.0, lambda lr: optax.sgd(lr, momentum=0.9),
                  "optax.sgd, momentum 0.9"),
    "adam": Recipe(5e-3, "sqrt", 1.0, optax.adam, "optax.adam, default betas"),
    "lars": Recipe(3.0, "linear", 2.0, lars,
                   "optimizers.lars: paper denominator, eta 1e-3, wd 1e-4, momentum 0.9"),
    "lamb": Recipe(1e-2, "sqrt", 1.0, lamb,
                   "optimizers.lamb: b 0.9/0.999, eps 1e-6, wd 0.01"),
}


@functools.lru_cache(maxsize=4)
def load_mnist1d(num_samples: int = 20000, cache_dir: str | None = None) -> dict[str, np.ndarray]:
  """Generates MNIST-1D offline (never the package's download path), optionally cached.

  Args:
    num_samples: examples generated in total; 80% train, 20% test (the package's split).
    cache_dir: folder for an ``.npz`` copy, reused when present; None keeps it in memory only.

  Returns:
    ``{"x": f32[n_train, 40], "y": i32[n_train], "x_test": ..., "y_test": ...}``.
  """
  import mnist1d  # pylint: disable=import-outside-toplevel  (slow import, only when generating)

  path = None if cache_dir is None else os.path.join(cache_dir, f"mnist1d_{num_samples}.npz")
  if path is not None and os.path.exists(path):
    with np.load(path) as stored:
      return dict(stored)
  args = mnist1d.data.get_dataset_args()
  args.num_samples = num_samples
  generated = mnist1d.data.make_dataset(args)
  data = {"x": generated["x"].astype(np.float32), "y": generated["y"].astype(np.int32),
          "x_test": generated["x_test"].astype(np.float32),
          "y_test": generated["y_test"].astype(np.int32)}
  if path is not None:
    os.makedirs(cache_dir, exist_ok=True)
    np.savez(path, **data)
  return data


def init_mlp(key: jax.Array, in_features: int) -> dict:
  """He-initialised MLP; leaves named ``kernel``/``bias`` so the default exclusions apply."""
  widths = (in_features, *HIDDEN_WIDTHS, NUM_CLASSES)
  params = {}
  for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
    key, sub = jax.random.split(key)
    name = "out" if i == len(widths) - 2 else f"hidden_{i}"
    params[name] = {"kernel": jax.random.normal(sub, (fan_in, fan_out)) * jnp.sqrt(2.0 / fan_in),
                    "bias": jnp.zeros((fan_out,))}
  return params


def mlp(params: dict, x: jax.Array) -> jax.Array:
  for i in range(len(HIDDEN_WIDTHS)):
    x = jax.nn.relu(x @ params[f"hidden_{i}"]["kernel"] + params[f"hidden_{i}"]["bias"])
  return x @ params["out"]["kernel"] + params["out"]["bias"]


def cross_entropy(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y).mean()


def train_one(data: dict[str, np.ndarray], recipe: Recipe, batch_size: int, epochs: int,
              seed: int) -> dict[str, Any]:
  """Trains one MLP; returns its learning rate, step count, final losses and test accuracy."""
  num_train = data["x"].shape[0]
  steps_per_epoch = num_train // batch_size
  if steps_per_epoch < 1:
    raise ValueError(f"large_batch: batch_size={batch_size} is larger than the training set "
                     f"({num_train} examples); raise --num_samples or lower the batch size.")
  total_steps = steps_per_epoch * epochs
  peak = scale_learning_rate(recipe.base_learning_rate, batch_size,
                             base_batch_size=BASE_BATCH_SIZE, rule=recipe.scaling_rule)
  schedule = warmup_polynomial_decay(
      peak, int(WARMUP_FRACTION * total_steps), total_steps, power=recipe.decay_power)
  tx = recipe.make(schedule)
  x, y = jnp.asarray(data["x"]), jnp.asarray(data["y"])

  def train_step(carry, indices):
    params, opt_state = carry
    loss, grads = jax.value_and_grad(cross_entropy)(params, x[indices], y[indices])
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  # One compiled epoch (a scan over its steps); epochs loop in Python with host-side shuffling,
  # which compiles several times faster than an outer scan on a busy CPU.
  @functools.partial(jax.jit, donate_argnums=(0,))
  def train_epoch(carry, order):
    carry, losses = jax.lax.scan(train_step, carry, order)
    return carry, losses.mean()

  start = time.perf_counter()
  params = init_mlp(jax.random.key(seed), x.shape[1])
  carry = (params, tx.init(params))
  rng = np.random.default_rng(seed)
  for _ in range(epochs):
    order = rng.permutation(num_train)[:steps_per_epoch * batch_size]
    carry, epoch_loss = train_epoch(carry, order.reshape(steps_per_epoch, batch_size))
  params = carry[0]
  final_loss = float(epoch_loss)
  wall = time.perf_counter() - start
  logits = mlp(params, jnp.asarray(data["x_test"]))
  test_accuracy = float(jnp.mean(jnp.argmax(logits, -1) == jnp.asarray(data["y_test"])))
  return {"peak_learning_rate": peak, "steps": total_steps,
          "train_loss": final_loss if np.isfinite(final_loss) else None,
          "test_accuracy": test_accuracy, "wall_s": wall}


def run_large_batch(batch_sizes: Sequence[int], optimizers: Sequence[str], epochs: int,
                    seed: int, *, data: dict[str, np.ndarray] | None = None) -> list[dict]:
  """Trains every (optimizer, batch size) pair once with ``seed``.

  Args:
    batch_sizes: global batch sizes, e.g. ``(128, 512, 4096)``.
    optimizers: names from :data:`RECIPES` (``"sgd"``, ``"adam"``, ``"lars"``, ``"lamb"``).
    epochs: passes over the training set (fixed across batch sizes).
    seed: seeds initialisation and shuffling.
    data: MNIST-1D arrays as :func:`load_mnist1d` returns them; generated when None.

  Returns:
    One dict per run: ``optimizer, batch_size, epochs, seed, peak_learning_rate, steps,
    train_loss`` (last epoch's mean; None if it diverged), ``test_accuracy, wall_s``.
  """
  unknown = [name for name in optimizers if name not in RECIPES]
  if unknown:
    raise ValueError(f"large_batch: optimizers={list(optimizers)!r} has unknown names {unknown}; "
                     f"allowed: {sorted(RECIPES)}")
  if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
    raise ValueError(f"large_batch: epochs={epochs!r} is not allowed; epochs must be an int >= 1.")
  if data is None:
    data = load_mnist1d()
  results = []
  for name in optimizers:
    for batch_size in batch_sizes:
      run = train_one(data, RECIPES[name], int(batch_size), epochs, seed)
      results.append({"optimizer": name, "batch_size": int(batch_size), "epochs": epochs,
                      "seed": seed, **run})
  return results


def markdown_table(results: list[dict]) -> str:
  """Test accuracy (%) per batch size (rows) and optimizer (columns), mean +- std over seeds."""
  names = list(dict.fromkeys(r["optimizer"] for r in results))
  batch_sizes = sorted({r["batch_size"] for r in results})
  lines = ["| batch | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
  for batch_size in batch_sizes:
    cells = []
    for name in names:
      runs = [r for r in results if r["optimizer"] == name and r["batch_size"] == batch_size]
      accuracy = 100 * np.array([r["test_accuracy"] for r in runs])
      spread = f" ± {accuracy.std():.1f}" if len(runs) > 1 else ""
      cells.append(f"{accuracy.mean():.1f}{spread} (lr {runs[0]['peak_learning_rate']:.3g})")
    lines.append(f"| {batch_size} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


FLAGS = flags.FLAGS


def _define_flags() -> None:
  """Command-line flags, defined only when run as a script: importers (the paper tables) reuse
  this module as a library, and absl flags are global to the process."""
  flags.DEFINE_string("out", "runs/large_batch", "Output folder for results.md / results.json.")
  flags.DEFINE_integer("epochs", 30, "Epochs per run (fixed across batch sizes).")
  flags.DEFINE_list("batch_sizes", ["128", "256", "512", "1024", "2048", "4096"], "Batch sizes.")
  flags.DEFINE_list("seeds", ["0"], "Seeds; the table reports mean ± std over them.")
  flags.DEFINE_list("optimizers", list(RECIPES), f"Optimizers, from {sorted(RECIPES)}.")
  flags.DEFINE_integer("num_samples", 20000, "MNIST-1D examples generated (80% train).")


def main(argv: Sequence[str]) -> None:
  del argv
  data = load_mnist1d(FLAGS.num_samples, FLAGS.out)
  batch_sizes = [int(b) for b in FLAGS.batch_sizes]
  results = []
  for seed in (int(s) for s in FLAGS.seeds):
    results += run_large_batch(batch_sizes, FLAGS.optimizers, FLAGS.epochs, seed, data=data)
  header = (f"MNIST-1D ({data['x'].shape[0]} train / {data['x_test'].shape[0]} test), MLP "
            f"{HIDDEN_WIDTHS}, {FLAGS.epochs} epochs, seeds {FLAGS.seeds}; test accuracy % "
            f"(peak lr); lr scaled from batch {BASE_BATCH_SIZE}: linear for sgd/lars, sqrt for "
            "adam/lamb.\n\n")
  table = header + markdown_table(results) + "\n"
  os.makedirs(FLAGS.out, exist_ok=True)
  with open(os.path.join(FLAGS.out, "results.md"), "w") as f:
    f.write(table)
  with open(os.path.join(FLAGS.out, "results.json"), "w") as f:
    json.dump({"recipes": {k: {"base_learning_rate": r.base_learning_rate,
                               "scaling_rule": r.scaling_rule, "decay_power": r.decay_power,
                               "description": r.description} for k, r in RECIPES.items()},
               "base_batch_size": BASE_BATCH_SIZE, "warmup_fraction": WARMUP_FRACTION,
               "results": results}, f, indent=2)
  print(table)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
