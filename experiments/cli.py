"""What the command-line entry points (``experiments.run``, ``experiments.sweep``,
``experiments.bench``, ``experiments.reproduce``) share: bad input reported in one line, without a
traceback (:func:`errors_in_one_line`; ``--verbose`` or ``TASC_JAX_VERBOSE=1`` shows the
traceback), a one-line error for a config file that does not exist or is not a config, for a
config argument it refuses, for a config field that does not exist and for any other flag (absl's,
or argparse's: :class:`ArgumentParser`; an unknown flag named as a config field, ``--method=topk``,
points to ``--config.method=topk``), and the exit of an interrupted run.

The config file's check runs before absl parses the flags: ml_collections defers a missing file's
error to the first use of the config, and ``--config.<field>`` overrides use it while the flags
are parsed, so without the check the user reads a traceback of some 40 lines.
"""

import argparse
import contextlib
import importlib.machinery
import importlib.util
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from absl import flags
import ml_collections

from configs import common as config_common
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


class ArgumentParser(argparse.ArgumentParser):
  """argparse's parser for the programs that use it, whose errors are raised as ValueError, to
  be one line (exit status 1) from :func:`errors_in_one_line` as the other programs' errors are,
  not printed after the usage (exit status 2)."""

  def error(self, message):
    raise ValueError(message)


def flags_parser(program: str) -> Callable[[list[str]], list[str]]:
  """absl's flag parsing for ``app.run(main, flags_parser=...)``, which exits with a one-line
  error (status 1): naming the path where ``--config`` names no file, or a file that makes no
  config (:func:`load_config`); naming the flag and the nearest field where a
  ``--config.<field>`` override names no field; and absl's own message for any other flag,
  with ``--config.<field>=<value>`` where the flag is named as a field of the config."""

  def parse(argv: list[str]) -> list[str]:
    with errors_in_one_line(program, show_traceback=verbose(argv)):
      config = None
      for i, arg in enumerate(argv[1:], 1):
        if arg.startswith("--config="):
          config = load_config(arg.partition("=")[2])
        elif arg == "--config" and i + 1 < len(argv):
          config = load_config(argv[i + 1])
      try:
        # Not app.parse_flags_with_usage: it prints the error on two lines, the second one
        # about --helpshort.
        return flags.FLAGS(argv)
      except flags.UnrecognizedFlagError as e:
        hint = _config_field_hint(e, config)
        raise ValueError(f"{one_line(e)}{hint} (--helpshort lists the flags)") from e
      except flags.Error as e:
        raise ValueError(f"{one_line(e)} (--helpshort lists the flags)") from e
      except (KeyError, AttributeError) as e:  # ml_collections: a field the config lacks
        raise KeyError(_unknown_field(e, argv)) from e
  return parse


def load_config(spec: str, what: str = "--config") -> Any:
  """Loads the config file of ``spec`` (``path/to/config.py[:arg]``) and calls its
  ``get_config(arg)``, so that whatever fails there is one line naming the file.

  :func:`flags_parser` calls it before absl parses the flags, for its errors; ml_collections
  then loads the file again (a config file is cheap to run). Where loading fails,
  ml_collections puts the traceback of a ValueError or TypeError of ``get_config`` (a mistyped
  config argument, ``:smok``) into the flag's message, and lets any other error (a file that is
  not Python, or defines no ``get_config``) escape with its traceback.

  Args:
    spec: the path and, after ``:``, the argument of ``get_config``.
    what: where ``spec`` comes from, for the message.

  Returns:
    What ``get_config`` returns.

  Raises:
    FileNotFoundError: there is no file at the path.
    ValueError: the file cannot be run as Python, defines no ``get_config``, or its
      ``get_config`` fails
      (a ValueError or TypeError of ``get_config``, which names what is wrong, is kept as it is;
      any other error is named with its type).
  """
  validation.check_config_file(spec, what)
  path, colon, arg = spec.partition(":")
  # Loaded as ml_collections loads it: any file name, not registered in sys.modules.
  loader = importlib.machinery.SourceFileLoader("config_check", path)
  module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
  try:
    loader.exec_module(module)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"{what}={spec!r}: {path} cannot be run as a Python config file "
                     f"({type(e).__name__}: {one_line(e)}); a config file is Python that "
                     "defines get_config(arg=None), as configs/quickstart.py does") from e
  if not callable(getattr(module, "get_config", None)):
    raise ValueError(f"{what}={spec!r}: {path} defines no get_config(arg=None); a config file "
                     "is Python that defines it, as configs/quickstart.py does")
  try:
    return module.get_config(*([arg] if colon else []))
  except (ValueError, TypeError) as e:
    raise ValueError(f"{what}={spec!r}: {one_line(e)}") from e
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"{what}={spec!r}: get_config of {path} raised {type(e).__name__}: "
                     f"{one_line(e)}") from e


def _config_field_hint(error: flags.UnrecognizedFlagError, config: Any) -> str:
  """For an unknown flag named as a field of ``config`` (``--method=topk``), ``; the config
  has a field 'method': set it with --config.method=topk``; else nothing. Without a config
  (``--config`` missing or not loaded) the fields of ``configs/common.py``'s ``base()``."""
  field = error.flagname
  fields = config if config is not None else config_common.base()
  for part in field.split("."):
    if not isinstance(fields, ml_collections.ConfigDict) or part not in fields:
      return ""
    fields = fields[part]
  given = str(error.flagvalue)
  value = given.partition("=")[2] if "=" in given else "<value>"
  return f"; the config has a field {field!r}: set it with --config.{field}={value}"


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
