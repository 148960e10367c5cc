"""DLRM on synthetic click logs, 8 simulated devices, the tables replicated (data parallel).

  python -m experiments.run --config=configs/dlrm.py --workdir=runs/dlrm

The synthetic click logs (``synthetic_ctr``, experiments/data/criteo.py) have MLPerf
DLRM-DCNv2's 26 tables capped at 2,000 rows and its multi-hot sizes capped at 4 IDs (76 lookups
a row), each table's IDs skewed so that its top 1% of rows takes 90% of its lookups, and labels
from a hidden teacher model; 16,384 rows train, 4,096 evaluate. DLRM
(experiments/models/dlrm.py: width 8, bottom 16, top 16, the dot interaction) trains with Adam,
batch 512, 2 epochs (64 steps); every device holds every table, and the gradient, tables
included, is all-reduced like any model's. ``results.json`` reports ``auc`` and ``log_loss``
over the evaluation rows.

Expected (seed 0): AUC 0.752, log-loss 0.503; with ``frozen=true`` (the tables kept at their
initial values) AUC 0.628, log-loss 0.545 (the dense features alone rank the clicks a little;
the teacher's rows are what the embeddings learn). Runtime: about 25 seconds on 2 CPU cores,
the first run also generating the logs (a second, cached).

Tables placed across the devices (compressors/parallel/embeddings.py): ``config.embedding``:
``placement`` (``replicated``, ``table``, ``row`` or ``column``, for every table, or ``auto``:
the planner's, compressors/embedding_planner.py), ``overrides`` (``"3:row,7:table"``: some
tables placed otherwise; not with ``auto``), ``row_reduction`` (``all_to_all`` or
``reduce_scatter``, row-placed tables' bags), ``optimizer`` (the placed tables': ``same``, the
run's, or ``rowwise_adagrad`` at ``learning_rate``), ``capacity`` (keys per bucket of a
training step's all-to-all; 0: every lookup of a device, nothing can overflow; -1: from the
skew of the training IDs, the planner's; an overflow is refused in one line), ``hot_rows``
(a string: rows of each row- or table-placed table replicated on every device,
compressors/parallel/hot_rows.py: ``"0"`` none, a count such as ``"64"``, a fraction of each
table's rows such as ``"0.01"``, or ``"auto"``, the planner's), ``hot_exchange`` (the
registered per-step method that exchanges the hot rows' gradient in the step, as the run's
chain does a dense parameter's: ``dense``, the float32 all-reduce, or any per-step method
without per-step inputs, e.g. ``topk``, ``int8``, ``qsgd``, ``bf16``, with its settings from
``config.compression.<name>`` and error feedback where it has it, its state checkpointed; or
``same``, ``config.method``; ``compression.error_feedback`` and ``seed`` apply, the rest of
``config.compression``'s own fields is the dense part's; not with ``hot_rows="0"``; the
planner prices it by the method's cost model), and the planner's inputs
(``auto``, ``hot_rows`` other than ``"0"`` or ``capacity=-1`` run it; it logs what it chose and
why, and results.json's ``embedding_planner`` has its predicted bytes and seconds per
collective): ``budget_bytes`` (a device's bytes for the tables, the hot rows and their
exchanges' error-feedback memories included; 0: none), ``link_gbit`` (the link between devices) and ``compute_seconds`` (a step's compute,
behind whose backward pass the all-reduces hide). Without compression each placement, with or
without hot rows, gives the replicated tables' losses to float rounding
(tests/test_dlrm_runner.py, tests/test_hot_rows.py).

Compression of the rows' all-to-alls (compressors/embedding_codecs.py; placed tables, row
reduction ``all_to_all``), each codec named as the registered per-step method whose transport it
reuses: ``exchange``, the forward rows (``dense``, ``bf16``, ``fp16``: sent bit-cast as 16-bit
integers, ``int8``, ``int4``: a float32 scale per row, int4 two codes a byte);
``gradient_exchange``, the rows' gradients (the same, or ``topk``: the ``topk_fraction`` of each
bucket's rows of largest norm, values and int32 indices, or ``threshold``: the rows whose L2
norm reaches ``threshold``, at most as many); ``error_feedback`` (true: what a device's
gradient codec did not send is added to the same row's next gradient it sends; its residual is
a whole bank per device, in the parameters' ``exchange`` leaves, checkpointed). Bad values are
refused in one line before anything compiles.

Arguments: ``smoke`` (2 steps on fewer rows, for tests), ``frozen=true``.
"""

from configs import common


def get_config(arg=None):
  args = common.parse_args(arg, smoke=False, frozen=False)
  c = common.base()
  c.dataset = "synthetic_ctr"
  c.data.update(dict(shapes="mlperf", max_rows=2000, max_hotness=4, num_train=16384,
                     num_eval=4096, seed=0, cache_dir=""))
  c.model = dict(name="dlrm", embedding_dim=8, bottom=(16,), top=(16,), interaction="dot",
                 frozen_embeddings=args["frozen"])
  c.embedding = dict(placement="replicated", overrides="", row_reduction="all_to_all",
                     optimizer="same", learning_rate=0.01, capacity=0, hot_rows="0",
                     budget_bytes=262144, link_gbit=10.0, compute_seconds=0.05,
                     exchange="dense", gradient_exchange="dense", error_feedback=True,
                     topk_fraction=0.25, threshold=1e-3, hot_exchange="dense")
  c.method = "dense"
  c.optimizer.update(dict(name="adam", learning_rate=0.01, b1=0.9, b2=0.999, eps=1e-8))
  c.batch_size = 512
  c.eval_batch_size = 4096
  c.num_epochs = 2.0
  c.log_every = 16
  c.checkpoint_every = 0
  if args["smoke"]:
    common.make_smoke(c)
    c.data.update(dict(num_train=2048, num_eval=512))
    c.eval_batch_size = 512
  return c
