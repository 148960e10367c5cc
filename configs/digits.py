"""scikit-learn's 8x8 digits (1,797 images, bundled offline), small CNN, 8 devices.

  python -m experiments.run --config=configs/digits.py:method=topk --workdir=runs/digits

Adam (lr 1e-3), batch 128, 100 epochs (1,100 steps). Expected: test accuracy and bytes per step
in ``results.json``, high-90s percent (the T1 pages of ``paper_figures/`` hold measured runs of
the suite's configs). Runtime: about a minute on 2 CPU cores. Arguments: ``method=<name>``,
``smoke``.
"""

from configs import common


def get_config(arg=None):
  args = common.parse_args(arg, method="dense", smoke=False)
  c = common.base()
  c.dataset = "digits"
  c.model = dict(name="cnn2d", channels=(32, 64), hidden=128)
  c.method = args["method"]
  c.optimizer.update(dict(name="adam", learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8))
  c.schedule.update(dict(name="cosine", warmup_epochs=1.0))
  c.batch_size = 128
  c.eval_batch_size = 360
  c.num_epochs = 100.0
  c.log_every = 50
  c.eval_every = 500
  c.checkpoint_every = 500
  c.compression.tasc.hessian_every = 50
  if args["smoke"]:
    common.make_smoke(c)
    c.model = dict(name="cnn2d", channels=(4,), hidden=8)
  return c
