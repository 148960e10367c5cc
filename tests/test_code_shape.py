"""The code's shape: no function longer than :data:`MAX_FUNCTION_LINES` lines of code, and every
repository path named in the README, the committed results pages and module docstrings exists."""

import ast
import itertools
import pathlib
import re

ROOT = pathlib.Path(__file__).parents[1]
PACKAGES = ("compressors", "tasc", "optimizers", "experiments", "configs", "tests", "benchmarks")
# Folders whose files a path named in text may point at.
TOP_LEVEL = (*PACKAGES, "paper_figures", ".ci")
MAX_FUNCTION_LINES = 60




def python_files():
  return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def lines_of_code(function: ast.FunctionDef | ast.AsyncFunctionDef, source: list[str]) -> int:
  """Non-blank lines from the ``def`` line to the function's end, its docstring left out."""
  docstring = set()
  first = function.body[0]
  if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
      and isinstance(first.value.value, str)):
    docstring = set(range(first.lineno, first.end_lineno + 1))
  return sum(1 for line in range(function.lineno, function.end_lineno + 1)
             if line not in docstring and source[line - 1].strip())


def long_functions(path: pathlib.Path) -> dict[str, int]:
  """``"file:function"`` -> lines of code of each function of ``path`` over the limit."""
  text = path.read_text()
  source = text.splitlines()
  name = path.relative_to(ROOT).as_posix()
  return {f"{name}:{node.name}": count for node in ast.walk(ast.parse(text))
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
          and (count := lines_of_code(node, source)) > MAX_FUNCTION_LINES}


def test_no_function_is_longer_than_the_limit():
  found = {}
  for path in python_files():
    found.update(long_functions(path))
  assert not found, "\n".join(f"{f}: {n} lines of code (at most {MAX_FUNCTION_LINES})"
                              for f, n in sorted(found.items()))


def test_lines_of_code_leave_out_the_docstring_and_blank_lines():
  text = 'def f():\n  """One.\n\n  Two.\n  """\n  x = 1\n\n  return x\n'
  function = ast.parse(text).body[0]
  assert lines_of_code(function, text.splitlines()) == 3


# A path: a top-level folder, then folders, ending in a file name with an extension or in "/";
# braces ("compressors/_{topk,randomk}.py") stand for alternatives.
_PATH = re.compile(r"(?<![\w./-])(?:%s)/[\w./{},-]*" % "|".join(re.escape(t) for t in TOP_LEVEL))


def expand_braces(path: str) -> list[str]:
  """``a/_{x,y}.py`` -> ``["a/_x.py", "a/_y.py"]`` (every brace group, in turn)."""
  parts = re.split(r"\{([^{}]*)\}", path)
  choices = [[text] if i % 2 == 0 else text.split(",") for i, text in enumerate(parts)]
  return ["".join(chosen) for chosen in itertools.product(*choices)]


def named_paths(text: str) -> set[str]:
  """The repository paths ``text`` names: each ends in a file name with an extension or in
  ``/``; a config argument (``configs/lm_stdlib.py:tiny``) and trailing punctuation are left
  out."""
  paths = set()
  for match in _PATH.finditer(text):
    token = match.group().rstrip(".,")
    for path in expand_braces(token):
      if path.endswith("/") or re.search(r"/[^/]*\w\.\w+$", path):
        paths.add(path)
  return paths


def module_docstrings():
  """``(file, docstring)`` of every Python file of the project that has a module docstring."""
  for path in python_files():
    docstring = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    if docstring:
      yield path.relative_to(ROOT).as_posix(), docstring


def pages():
  """``(file, text)`` of the README and the committed results pages."""
  for path in [ROOT / "README.md", *sorted(ROOT.glob("paper_figures/*.md")),
               *sorted(ROOT.glob("benchmarks/results/**/*.md"))]:
    yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_named_paths_exist():
  texts = [*pages(), *module_docstrings()]
  named = {f"{source}: {path}" for source, text in texts for path in named_paths(text)}
  missing = {n for n in named if not (ROOT / n.split(": ", 1)[1]).exists()}
  assert not missing, "\n".join(sorted(missing))


def test_named_paths_are_found_expanded_and_trimmed():
  text = ("See `compressors/_{topk,randomk}.py`, configs/lm_stdlib.py:tiny, tasc/_fused.py. "
          "Runs go to runs/t1/, results to benchmarks/results/gpu/ and the package "
          "compressors.network; not a path: configs/paper")
  assert named_paths(text) == {"compressors/_topk.py", "compressors/_randomk.py",
                               "configs/lm_stdlib.py", "tasc/_fused.py",
                               "benchmarks/results/gpu/"}
  assert not (ROOT / "tasc/made_up.py").exists()
  assert named_paths("`tasc/made_up.py`") == {"tasc/made_up.py"}
