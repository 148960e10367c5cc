"""What the command-line entry points (``experiments.run``, ``experiments.sweep``,
``experiments.bench``, ``experiments.reproduce``) share: bad input reported in one line, without a
traceback (:func:`errors_in_one_line`; ``--verbose`` or ``TASC_JAX_VERBOSE=1`` shows the
traceback), a one-line error for a config file that does not exist or a config field that does
not exist, and the exit of an interrupted run.

The config file's check runs before absl parses the flags: ml_collections defers a missing file's
error to the first use of the config, and ``--config.<field>`` overrides use it while the flags
are parsed, so without the check the user reads a traceback of some 40 lines.
"""

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

from absl import app
from absl import flags

from experiments import interrupt
from experiments import lock
from experiments import provenance
from experiments import validation


VERBOSE_FLAG = "--verbose"
VERBOSE_ENV = "TASC_JAX_VERBOSE"
VERBOSE_HELP = (f"show the traceback of an error instead of its one line (also with "
                f"{VERBOSE_ENV}=1)")
# What bad input raises (a config value, a file, a workdir): the message says it all, and a
# traceback would bury it. Other exceptions (a bug, a crash in XLA) keep their traceback.
BAD_INPUT = (ValueError, TypeError, KeyError, NameError, OSError, lock.WorkdirInUse)
# For the absl programs, which read it through verbose() (the flags may fail to parse).
flags.DEFINE_bool(VERBOSE_FLAG[2:], False, VERBOSE_HELP)


def verbose(argv: Sequence[str] | None = None) -> bool:
  """Whether the command line (``sys.argv`` by default) or the environment asks for tracebacks.
  Read from the arguments themselves: flag parsing may be what fails."""
  argv = sys.argv if argv is None else argv
  return VERBOSE_FLAG in argv or os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def one_line(error: BaseException) -> str:
  """``error``'s message on one line (a KeyError's without the quotes ``str`` adds)."""
  message = error.args[0] if isinstance(error, KeyError) and len(error.args) == 1 else error
  lines = [line.strip() for line in str(message).splitlines() if line.strip()]
  return "; ".join(lines) or type(error).__name__


@contextlib.contextmanager
def errors_in_one_line(program: str, *, show_traceback: bool | None = None) -> Iterator[None]:
  """Exits with status 1 and ``<program>: <message>`` on one line when the body raises one of
  :data:`BAD_INPUT`; with ``show_traceback`` (default: :func:`verbose`) the error propagates."""
  try:
    yield
  except BAD_INPUT as e:
    if verbose() if show_traceback is None else show_traceback:
      raise
    sys.exit(f"{program}: {one_line(e)}")


def flags_parser(program: str) -> Callable[[list[str]], list[str]]:
  """absl's flag parsing for ``app.run(main, flags_parser=...)``, which exits with a one-line
  error (status 1) naming the path where ``--config`` names no file, and naming the flag and the
  nearest field where a ``--config.<field>`` override names no field."""

  def parse(argv: list[str]) -> list[str]:
    with errors_in_one_line(program, show_traceback=verbose(argv)):
      for i, arg in enumerate(argv[1:], 1):
        if arg.startswith("--config="):
          validation.check_config_file(arg.partition("=")[2])
        elif arg == "--config" and i + 1 < len(argv):
          validation.check_config_file(argv[i + 1])
      try:
        return app.parse_flags_with_usage(argv)
      except (KeyError, AttributeError) as e:  # ml_collections: a field the config lacks
        raise KeyError(_unknown_field(e, argv)) from e
  return parse


def _unknown_field(error: BaseException, argv: Sequence[str]) -> str:
  """ml_collections' message for an unknown field (the field's repr, a newline, "Did you mean
  ...?"), on one line with the flag that names it."""
  message = error.args[0] if error.args else error
  if isinstance(message, KeyError):  # ml_collections' AttributeError wraps its KeyError
    message = message.args[0]
  name, _, hint = str(message).partition("\n")
  name = name.strip("'\"")
  flag = next((a for a in argv if a.startswith("--config.")
               and name in a.partition("=")[0].split(".")), "--config")
  return (f"{flag}: the config has no field {name!r}" + (f"; {hint}" if hint else "")
          + " (every field: configs/common.py)")


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
