"""A decoder-only Transformer language model on the Python standard library's source.

  python -m experiments.run --config=configs/lm_stdlib.py:tiny --workdir=runs/lm_tiny
  python -m experiments.run --config=configs/lm_stdlib.py:base,method=tasc --workdir=runs/lm_base

The corpus is this Python's own standard library, read at run time (``experiments/data/stdlib.py``:
the ``.py`` files outside test folders, 12.1 MB in 734 files on Python 3.11.7, split into
training and validation by a hash of each file's path), tokenized by a byte-level BPE trained
once on the training files and cached in ``--config.data.cache_dir`` (default
``~/.cache/tasc-jax/tokenizers``). The model (``experiments/models/decoder.py``) is GPT-2's
layout: pre-LN blocks, GELU, tied embeddings, causal attention. AdamW (lr, betas 0.9/0.95,
weight decay 0.1 as for GPT-3) with a linear warm-up over the first 10% of steps and cosine decay;
every method trains with this one recipe, chosen on dense. The config pins the Python version
(``config.data.python_version``) and may pin the corpus's sha256 (``config.data.corpus_sha256``,
'' by default: getting a config reads no corpus); the loader checks what is pinned, and records
the sha256 of the corpus it read in ``results.json``.

Tiers (every one on 8 devices; simulated on CPU):

* ``micro``: 2 layers, 64 wide, 4 heads, vocabulary 2,048, sequences of 64 tokens: 0.24M
  parameters; batch 64 sequences (4,096 tokens a step, 8 sequences per worker), 1,000 steps
  (4.1M tokens, about 17 per parameter). The CPU tier of the language-model tables.
* ``tiny``: 4 layers, 128 wide, 4 heads, vocabulary 2,048, sequences of 128 tokens: 1.07M
  parameters; batch 64 sequences (8,192 tokens a step), 1,000 steps (8.2M tokens, 2.3 passes
  over the 3.6M training tokens).
* ``small``: 6 layers, 256 wide, 8 heads, vocabulary 4,096, 256 tokens: 5.8M parameters;
  batch 128 (32,768 tokens a step), 2,000 steps.
* ``base``: 8 layers, 512 wide, 8 heads, vocabulary 8,192, 256 tokens: 29.5M parameters;
  batch 256 (65,536 tokens a step), 2,000 steps. The GPU tier: its matrix products run in
  bfloat16, its parameters, optimizer state and gradients stay float32 (mixed precision,
  ``config.model.compute_dtype``; ``dtype=float32`` turns it off).
* ``smoke``: 2 steps of a 1-layer, 16-wide model, for tests.

Expected: validation loss (nats per token, and ``test_bits_per_byte``) in ``results.json``; the
language-model tables (``paper_figures/t1_lm.md``) record what the tiers reached. Runtime: minutes
a run for ``tiny`` on 2 CPU cores, the tables record how long on which machine.

Corpus (``corpus``): ``stdlib`` (the default, above) or ``pypi``, the Python source of a pinned
list of packages from PyPI (``experiments/data/pypi_corpus/__init__.py``: 15 packages, 85.9 MB of
source, 22.9M training tokens at the ``base`` tier's vocabulary), for the GPU tier, which sees
16.4M tokens and overfits the standard library's 4M. Its archives are fetched once into the cache
folder ``corpus_dir`` (``python -m experiments.data.pypi_corpus --cache_dir=DIR``; '': the
default, ``~/.cache/tasc-jax/pypi_corpus``), which becomes ``config.data_dir``: a run extracts
them there on first use without the network. The config pins the corpus's sha256 and no Python
version (the packages' source is the same on every Python).

Arguments (``key=value`` joined by commas): the tier (``micro``/``tiny``/``small``/``base``/``smoke``),
``method`` (see ``configs/common.py``), ``steps`` (0: the tier's), ``lr`` (0: the tier's),
``workers`` (devices; 0: 8), ``seed``, ``cache`` (the tokenizer cache folder), ``dtype`` (the
matrix products' ``float32`` or ``bfloat16``; '': the tier's), ``corpus`` (``stdlib``/``pypi``),
``corpus_dir`` (``pypi``'s cache folder; '': the default), ``fsdp`` (1: every device its own
island; more: islands of ``fsdp`` devices, ``config.mesh``).
"""

import platform

from configs import common

MODEL_SIZES = {
    "micro": dict(model=dict(hidden=64, num_layers=2, num_heads=4, max_length=64),
                  vocab_size=2048, seq_len=64, batch_size=64, num_steps=1000,
                  learning_rate=3e-3, eval_sequences=512),
    "tiny": dict(model=dict(hidden=128, num_layers=4, num_heads=4, max_length=128),
                 vocab_size=2048, seq_len=128, batch_size=64, num_steps=1000,
                 learning_rate=3e-3, eval_sequences=512),
    "small": dict(model=dict(hidden=256, num_layers=6, num_heads=8, max_length=256),
                  vocab_size=4096, seq_len=256, batch_size=128, num_steps=2000,
                  learning_rate=2e-3, eval_sequences=1024),
    "base": dict(model=dict(hidden=512, num_layers=8, num_heads=8, max_length=256,
                            compute_dtype="bfloat16"),
                 vocab_size=8192, seq_len=256, batch_size=256, num_steps=2000,
                 learning_rate=1e-3, eval_sequences=2048),
    "smoke": dict(model=dict(hidden=16, num_layers=1, num_heads=2, max_length=16),
                  vocab_size=300, seq_len=16, batch_size=16, num_steps=2,
                  learning_rate=1e-3, eval_sequences=16),
}
CORPORA = ("stdlib", "pypi")
# The sha256 of the pypi corpus (experiments.data.pypi_corpus.CORPUS_SHA256, which a test checks
# this against; configs import nothing of experiments).
PYPI_CORPUS_SHA256 = "578345c5c63f58382bdfd097dc585a0945b7badf0ae8cf75924ff3deb1c80815"


def get_config(arg=None):
  args = common.parse_args(arg, variant="tiny", method="dense", steps=0, lr=0.0, workers=0,
                           seed=0, cache="", dtype="", smoke=False, corpus="stdlib",
                           corpus_dir="", fsdp=1)
  if args["corpus"] not in CORPORA:
    raise ValueError(f"configs/lm_stdlib.py: corpus={args['corpus']!r}; allowed: {CORPORA}")
  tier_name = "smoke" if args["smoke"] else args["variant"]
  if tier_name not in MODEL_SIZES:
    raise ValueError(f"configs/lm_stdlib.py: tier {tier_name!r} is not one of "
                     f"{sorted(MODEL_SIZES)}")
  tier = MODEL_SIZES[tier_name]
  c = common.base()
  c.dataset = "stdlib_lm"
  c.data = dict(seq_len=tier["seq_len"], vocab_size=tier["vocab_size"], eval_fraction=0.05,
                eval_sequences=tier["eval_sequences"], cache_dir=args["cache"],
                python_version=platform.python_version(), corpus_sha256="")
  if args["corpus"] == "pypi":
    c.data.update(dict(corpus="pypi", corpus_sha256=PYPI_CORPUS_SHA256, python_version=""))
    c.data_dir = args["corpus_dir"]
  c.model = dict(name="decoder_lm", **{"compute_dtype": "float32", **tier["model"]})
  if args["dtype"]:
    c.model.compute_dtype = args["dtype"]
  c.method = args["method"]
  c.optimizer.update(dict(name="adamw", learning_rate=args["lr"] or tier["learning_rate"],
                          b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))
  c.num_devices = args["workers"] or 8
  c.mesh.fsdp = args["fsdp"]  # > 1: islands of fsdp devices sharing one sharded model
  c.batch_size = tier["batch_size"]
  c.eval_batch_size = max(c.num_devices, min(256, tier["eval_sequences"]))
  c.num_steps = args["steps"] or tier["num_steps"]
  # In steps: an epoch's length depends on the tokenizer, trained after the config is written.
  # Without warm-up AdamW at 3e-3 stalled at the unigram loss (6.4 nats) for the CPU tier's first
  # 120 steps; with 10% it fell to 5.1 in 200.
  c.schedule.update(dict(name="cosine", warmup_steps=max(1, c.num_steps // 10)))
  c.log_every = 10
  c.eval_every = max(1, c.num_steps // 10)
  c.checkpoint_every = max(1, c.num_steps // 4)
  c.keep_checkpoints = 1
  c.compression.seed = c.seed = args["seed"]
  if args["smoke"]:
    common.make_smoke(c)
  return c
