"""What the command-line entry points (``experiments.run``, ``experiments.sweep``) share: a
one-line error for a config file that does not exist, and the exit of an interrupted run.

The config file's check runs before absl parses the flags: ml_collections defers a missing file's
error to the first use of the config, and ``--config.<field>`` overrides use it while the flags
are parsed, so without the check the user reads a traceback of some 40 lines.
"""

import signal
import sys
from collections.abc import Callable
from typing import NoReturn

from absl import app

from experiments import interrupt
from experiments import provenance
from experiments import validation


def flags_parser(program: str) -> Callable[[list[str]], list[str]]:
  """absl's flag parsing for ``app.run(main, flags_parser=...)``, which first exits with a
  one-line error (status 1) naming the path where ``--config`` names no file."""

  def parse(argv: list[str]) -> list[str]:
    for i, arg in enumerate(argv[1:], 1):
      if arg.startswith("--config="):
        spec = arg.partition("=")[2]
      elif arg == "--config" and i + 1 < len(argv):
        spec = argv[i + 1]
      else:
        continue
      try:
        validation.check_config_file(spec)
      except FileNotFoundError as e:
        sys.exit(f"{program}: {e}")
    return app.parse_flags_with_usage(argv)
  return parse


def exit_interrupted(e: BaseException, *, is_main: bool, name_run: bool = False) -> NoReturn:
  """Exits as a run stopped by a signal: ``interrupted at step N; resume with: <command>``.

  Args:
    e: the :class:`experiments.interrupt.Interrupted` of a run stopped at a step boundary, or a
      KeyboardInterrupt (a Ctrl-C outside the training loop: before the run started or after it
      ended).
    is_main: whether this is process 0, which alone prints.
    name_run: whether to name the run's directory (a sweep's runs).

  Raises:
    SystemExit: with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).
  """
  if isinstance(e, interrupt.Interrupted):
    where = f" at step {e.step}" + (f" of {e.workdir}" if name_run else "")
    status = e.exit_status
  else:
    where, status = "", 128 + signal.SIGINT
  if is_main:
    print(f"interrupted{where}; resume with: {provenance.command()}", file=sys.stderr,
          flush=True)
  sys.exit(status)
