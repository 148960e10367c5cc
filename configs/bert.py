"""BERT masked-LM pre-training with LAMB (You et al. 2020), BERT-base or a tiny BERT.

  python -m experiments.run --config=configs/bert.py:base --config.data_dir=/data/text \
      --workdir=runs/bert_base
  python -m experiments.run --config=configs/bert.py:tiny,pydoc=true --workdir=runs/bert_tiny

Raw ``*.txt`` files under ``--config.data_dir`` (or, with ``pydoc=true``, the English help texts
CPython ships in ``pydoc_data/topics.py``) are tokenized by a WordPiece vocabulary trained on the
corpus once and shared by every process through ``--config.data.cache_dir`` (default
``~/.cache/tasc-jax/tokenizers``; ``--config.data.tokenizer_sha256`` pins the one a run recorded)
or loaded from ``--config.data.vocab_file``, cut into 128-token sequences, and masked
dynamically (15%, 80/10/10). LAMB with weight decay 0.01, linear warmup over the first 1% of
steps and linear decay (power 1), as in the LAMB paper.

Variants: ``base`` (BERT-base, 110M parameters, vocabulary 30,522, batch 4096, lr 6e-3, 7,037
steps, the length of the LAMB paper's first phase at batch 64K), ``tiny`` (2 layers, 128 hidden,
2 heads, vocabulary 8,000, batch 256, lr 2e-3, 2,000 steps).
Expected: BERT-base's masked-LM accuracy reaches about 70% on Wikipedia + books after full
pre-training (published); runtime: days on a GPU pod, and hours on a CPU for the tiny model's
2,000 steps of 256 sequences (minutes on a GPU).
Arguments: ``base|tiny``, ``method=<name>``, ``pydoc=true``, ``smoke``.
"""

from configs import common

_VARIANTS = {
    "base": dict(model=dict(name="bert", hidden=768, num_layers=12, num_heads=12,
                            intermediate=3072),
                 vocab_size=30522, batch_size=4096, learning_rate=6e-3, num_steps=7037),
    "tiny": dict(model=dict(name="bert", hidden=128, num_layers=2, num_heads=2,
                            intermediate=512),
                 vocab_size=8000, batch_size=256, learning_rate=2e-3, num_steps=2000),
}


def get_config(arg=None):
  args = common.parse_args(arg, variant="base", method="dense", pydoc=False, smoke=False)
  if args["variant"] not in _VARIANTS:
    raise ValueError(f"bert config: variant {args['variant']!r} is not one of {sorted(_VARIANTS)}")
  variant = _VARIANTS[args["variant"]]
  c = common.base()
  c.dataset = "pydoc_text" if args["pydoc"] or args["smoke"] else "text"
  c.data = dict(seq_len=128, max_predictions=20, vocab_size=variant["vocab_size"],
                eval_fraction=0.05, cache_dir="", tokenizer_sha256="")
  c.model = variant["model"]
  c.method = args["method"]
  c.optimizer.update(dict(name="lamb", learning_rate=variant["learning_rate"], b1=0.9, b2=0.999,
                          eps=1e-6, weight_decay=0.01))
  c.schedule.update(dict(name="warmup_poly", power=1.0))
  c.batch_size = variant["batch_size"]
  c.eval_batch_size = 256
  c.num_steps = variant["num_steps"]
  c.log_every = 50
  c.eval_every = 500
  c.checkpoint_every = 500
  if args["smoke"]:
    common.make_smoke(c, batch_size=16)
    c.data.update(dict(seq_len=32, max_predictions=5, vocab_size=500))
    c.model = dict(name="bert", hidden=16, num_layers=1, num_heads=2, intermediate=32,
                   max_length=32)
  return c
