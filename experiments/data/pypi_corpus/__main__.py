"""Fetches and extracts the PyPI corpus (:mod:`experiments.data.pypi_corpus`) and prints its size
and sha256; with ``--tokens=V``, its training tokens with the byte-level BPE of ``V`` tokens that
``stdlib_lm`` trains (cached in ``--tokenizer_cache``, as a run's ``config.data.cache_dir``).

  python -m experiments.data.pypi_corpus --cache_dir=/path/to/cache [--offline] [--tokens=8192]

Bad input, a failed download, a refused archive: one line on stderr, exit status 1
(``--verbose``: the traceback).
"""

import os
import pathlib
import sys

from experiments import cli
from experiments.data import pypi_corpus
from experiments.data import stdlib

PROGRAM = "experiments.data.pypi_corpus"


def parse(argv):
  parser = cli.ArgumentParser(prog=f"python -m {PROGRAM}", description=__doc__.split("\n")[0])
  parser.add_argument("--cache_dir", default=pypi_corpus.default_cache_dir(),
                      help="the cache folder (archives/ and the extracted corpus)")
  parser.add_argument("--offline", action="store_true",
                      help="download nothing: extract the archives already in the cache")
  parser.add_argument("--tokens", type=int, default=0,
                      help="count the training tokens with a BPE of this many tokens (0: do not)")
  parser.add_argument("--eval_fraction", type=float, default=0.05,
                      help="the files held out for validation (configs/lm_stdlib.py's 0.05)")
  parser.add_argument("--tokenizer_cache", default="",
                      help="the tokenizer cache folder ('': experiments.data.tokenizer's default)")
  parser.add_argument(cli.VERBOSE_FLAG, action="store_true", help=cli.VERBOSE_HELP)
  return parser.parse_args(argv)


def main(argv=None) -> None:
  with cli.errors_in_one_line(PROGRAM):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.tokens and args.tokens < stdlib.MIN_VOCAB_SIZE:
      raise ValueError(f"--tokens={args.tokens}: allowed 0 or >= {stdlib.MIN_VOCAB_SIZE}")
    paths = ([os.path.join(pypi_corpus.archives_folder(args.cache_dir), a.filename)
              for a in pypi_corpus.ARCHIVES] if args.offline else pypi_corpus.fetch(args.cache_dir))
    folder = pypi_corpus.extract(args.cache_dir)
    corpus = stdlib.read_corpus(folder)
    archive_bytes = sum(os.path.getsize(p) for p in paths)
    print(f"archives: {len(paths)} in {pypi_corpus.archives_folder(args.cache_dir)}, "
          f"{archive_bytes / 1e6:.1f} MB, sha256 checked")
    print(f"corpus: {folder}: {len(corpus.paths)} files, {corpus.num_bytes / 1e6:.1f} MB")
    pinned = pypi_corpus.CORPUS_SHA256
    verdict = ("the pinned one" if corpus.sha256 == pinned
               else f"NOT the pinned {pinned or '(none)'}")
    print(f"corpus sha256: {corpus.sha256} ({verdict})")
    if args.tokens:
      train, _ = corpus.split(args.eval_fraction)
      shared = stdlib.build_tokenizer(train, args.tokens, args.tokenizer_cache)
      stream = stdlib.token_stream(shared, train, pathlib.Path(shared.path).parent)
      train_bytes = sum(len(t.encode("utf-8")) for t in train)
      print(f"training tokens (BPE of {args.tokens}, {len(train)} files, "
            f"{train_bytes / 1e6:.1f} MB): {stream.size:,} ({stream.size / train_bytes:.3f} "
            f"per byte); tokenizer {shared.path} sha256 {shared.sha256}")


if __name__ == "__main__":
  main()
