"""T2 settings: large-batch training, SGD / Adam / LARS / LAMB on MNIST-1D, Adam vs LAMB on
BERT-tiny (masked LM on CPython's ``pydoc_data`` help texts).

  python -m experiments.reproduce --target=t2              # quick
  python -m experiments.reproduce --target=t2 --full       # full (its own run folders)

Both go through the runner. MNIST-1D runs are the sweep ``configs/paper/t2_mnist1d.py`` of
``configs/paper/large_batch.py`` (an MLP, learning rates tuned once at batch 128 and scaled with
the batch). BERT-tiny runs are the sweep of ``configs/paper/t2_bert.py``
(``configs/bert.py:tiny,pydoc=true``) with a fixed number of epochs at every batch size: each
optimizer's peak rate is first chosen from ``learning_rates`` at the smallest batch size (lowest
final training loss), then scaled by ``sqrt(batch / base)``.

Quick (default): MNIST-1D 30 epochs x 2 seeds (48 runs); BERT 8 epochs (about 900 training
sequences of 128 tokens) at batch 32 to 256: 5 rate-selection runs at batch 32 and 6 more at the
other batch sizes (``paper_figures/t2.md`` records how long they took). ``full``: MNIST-1D 60
epochs x 3 seeds, BERT 40 epochs at batch 64 to 512 (hours on a CPU).
"""

import ml_collections

from configs import common


def get_config(arg=None):
  args = common.parse_args(arg, full=False)
  full = args["full"]
  c = ml_collections.ConfigDict()
  c.mnist1d = dict(optimizers=("sgd", "adam", "lars", "lamb"),
                   batch_sizes=(128, 256, 512, 1024, 2048, 4096),
                   epochs=60 if full else 30, seeds=3 if full else 2, num_samples=20000)
  c.bert = dict(optimizers=("adam", "lamb"),
                batch_sizes=(64, 128, 256, 512) if full else (32, 64, 128, 256),
                epochs=40 if full else 8, base_batch_size=256,
                # Candidate peak rates at base_batch_size (scaled by sqrt(batch / base)); each
                # optimizer's is chosen at the smallest batch size by final training loss.
                # 1e-3 is the usual BERT-small Adam rate; 2e-3 is configs/bert.py's tiny LAMB
                # rate, set for 2,000 steps: in these 24-224 steps LAMB's update (lr x the
                # layer's norm) moves the weights far less than Adam's, hence the larger ones.
                learning_rates={"adam": (1e-3, 3e-3), "lamb": (2e-3, 1e-2, 5e-2)},
                warmup_fraction=0.1)
  return c
