"""The code's shape: no function longer than :data:`MAX_FUNCTION_LINES` lines of code, and every
repository path named in the README, the committed results pages and module docstrings exists."""

import ast
import itertools
import os
import pathlib
import re
import subprocess
import sys

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


def foreign_private_imports(path: pathlib.Path) -> list[str]:
  """``"file:line module"`` of each module of another top-level package that ``path`` imports
  whose dotted name has a private part (``tasc._fused``, ``from tasc import _scores``)."""
  name = path.relative_to(ROOT).as_posix()
  own = name.split("/")[0]
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      modules = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      modules = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    else:
      continue
    found += [f"{name}:{node.lineno} {module}" for module in modules
              if module.split(".")[0] in PACKAGES and module.split(".")[0] != own
              and any(part.startswith("_") and not part.startswith("__")
                      for part in module.split("."))]
  return found


def test_no_module_imports_another_packages_private_module():
  """A package's private modules are its own: other packages reach them through its public
  names. Tests are left out, as they test the private modules themselves."""
  found = [hit for path in python_files() if not path.is_relative_to(ROOT / "tests")
           for hit in foreign_private_imports(path)]
  assert not found, "\n".join(found)


def test_readme_says_what_it_is_first_and_leaves_migration_notes_to_the_changelog():
  """A newcomer reads what the project is on the README's first screen; how to move from an
  older layout is history, kept in CHANGELOG.md."""
  readme = (ROOT / "README.md").read_text().splitlines()
  headings = [line for line in readme if line.startswith("#")]
  assert "## What it is" in readme[:30], headings[:5]
  assert not [h for h in headings if "migrat" in h.lower()], headings
  assert "### Migrating from the previous layout" in (ROOT / "CHANGELOG.md").read_text()


def heading_anchors(page: pathlib.Path) -> set[str]:
  """The anchors GitHub gives the Markdown headings of ``page``: ``"## The API, by example"`` ->
  ``"the-api-by-example"``."""
  return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
          for line in page.read_text().splitlines() if line.startswith("#")}


def test_relative_links_of_the_pages_resolve():
  """Every relative link of the README, the changelog and the results pages names a file that
  exists, and after a ``#`` one of its headings."""
  broken = []
  for source, text in [*pages(), ("CHANGELOG.md", (ROOT / "CHANGELOG.md").read_text())]:
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
      if re.match(r"[a-z]+:", target):  # a web address
        continue
      path, _, anchor = target.partition("#")
      linked = (ROOT / source).parent / path if path else ROOT / source
      if not linked.exists() or (anchor and anchor not in heading_anchors(linked)):
        broken.append(f"{source}: {target}")
  assert not broken, "\n".join(broken)


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: pathlib.Path, known: set[str]) -> dict[str, int]:
  """Project module -> the line where ``path`` imports it, at any depth (a function's import
  too): ``from a import b`` imports ``a.b`` when that is a module, else ``a``."""
  found = {}
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      modules = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      modules = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known
                 else node.module for alias in node.names]
    else:
      continue
    found.update({m: node.lineno for m in modules if m in known})
  return found


def import_graph() -> dict[str, dict[str, int]]:
  """Module -> the project modules it imports (and where), for every module but the tests."""
  paths = {_module_name(p): p for p in python_files() if not p.is_relative_to(ROOT / "tests")}
  return {name: _imported_modules(path, set(paths)) for name, path in paths.items()}


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
  """The circles of ``graph``: each strongly connected set of two or more modules (Tarjan)."""
  index, low, stack, on_stack, circles = {}, {}, [], set(), []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for nxt in graph.get(node, {}):
      if nxt not in index:
        visit(nxt)
        low[node] = min(low[node], low[nxt])
      elif nxt in on_stack:
        low[node] = min(low[node], index[nxt])
    if low[node] == index[node]:
      members = []
      while not members or members[-1] != node:
        members.append(stack.pop())
        on_stack.discard(members[-1])
      if len(members) > 1:
        circles.append(sorted(members))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return circles


def test_no_import_circle():
  """No two modules import each other, directly or around a loop, at any depth (an import
  inside a function only hides a circle). A package's ``__init__`` counts as its own module:
  it re-exports its modules' names, and a module importing a sibling does not run it again."""
  assert not import_circles(import_graph())


def test_the_circle_check_finds_a_circle():
  assert import_circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [
      ["a", "b", "c"]]


# The library packages (no command-line code): a project import inside one of their functions
# would hide a circle from test_no_import_circle's readers, and a lazy one (a module
# ``__getattr__`` importing on first use, as the planner's names once were) hides what a module
# loads. None is excepted.
_LIBRARY = ("compressors", "tasc", "optimizers")


def test_no_project_import_inside_a_function_in_the_library():
  """Third-party imports inside functions (JAX's internals the network model reads) are not this
  test's."""
  found = []
  for package in _LIBRARY:
    for path in sorted((ROOT / package).rglob("*.py")):
      name = path.relative_to(ROOT).as_posix()
      for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
          continue
        for inner in ast.walk(node):
          if isinstance(inner, (ast.Import, ast.ImportFrom)):
            module = inner.module if isinstance(inner, ast.ImportFrom) else inner.names[0].name
            if module.split(".")[0] in PACKAGES:
              found.append(f"{name}:{inner.lineno} {module}")
  assert not found, "\n".join(found)


def test_importing_the_library_loads_no_planner_and_no_scipy():
  """The planner (scipy's integer programming) is imported by whoever plans
  (``from compressors.network import planner``), not re-exported or loaded lazily."""
  code = ("import sys, compressors, tasc, optimizers; "
          "print(sorted(m for m in sys.modules if m.split('.')[0] == 'scipy' "
          "or m == 'compressors.network.planner'), hasattr(compressors, 'plan'))")
  loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert loaded.stdout.strip() == "[] False", loaded.stdout


def test_the_harness_imports_no_method_module():
  """``compressors/parallel`` knows no method: of the project it imports only the network
  model, itself and the method protocol (which the methods import too)."""
  allowed = ("compressors.network", "compressors.parallel", "compressors.method_protocol")
  graph = import_graph()
  found = [f"{name} imports {module}" for name, imported in graph.items()
           if name.startswith("compressors.parallel") for module in imported
           if not module.startswith(allowed)]
  assert not found, "\n".join(found)


def test_the_worker_simulator_knows_no_aggregator_and_no_method():
  """``compressors.worker_sim`` models the workers alone: the aggregators import it, never the
  other way round, and it imports no other module of the project."""
  graph = import_graph()
  found = [m for m in graph["compressors.worker_sim"] if m.split(".")[0] in PACKAGES]
  assert not found, found
  assert "compressors.worker_sim" in graph["compressors.aggregation"]


# ``method.family == ...`` (or the other way round): a method's family, not an argument's.
_FAMILY_COMPARISON = re.compile(r"\.family\b\s*(==|!=)|(==|!=)\s*[\w\[\]().]*\.family\b")


def test_at_most_three_family_comparisons_each_with_its_reason():
  """A family needs of the assembly what its method's hooks supply; what compares a method's
  family is rare and says why in a comment on the line or the line above."""
  found = []
  for path in python_files():
    if path.is_relative_to(ROOT / "tests"):
      continue
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
      code = line.split("#")[0]
      if _FAMILY_COMPARISON.search(code):
        commented = "#" in line or lines[number - 2].strip().startswith("#")
        found.append((f"{path.relative_to(ROOT)}:{number}", commented))
  assert len(found) <= 3, found
  assert all(commented for _, commented in found), found


def test_the_scaling_fits_import_numpy_and_scipy_only():
  """``experiments/scaling.py`` is cheap to import: at its top level it imports the standard
  library, numpy and scipy, nothing of the project and no JAX (its command line imports
  ``experiments.cli`` when it runs)."""
  tree = ast.parse((ROOT / "experiments" / "scaling.py").read_text())
  found = set()
  for node in tree.body:
    if isinstance(node, ast.Import):
      found.update(alias.name.split(".")[0] for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      found.add(node.module.split(".")[0])
  third_party = found - set(sys.stdlib_module_names)
  assert third_party == {"numpy", "scipy"}, found


def _code(path: pathlib.Path) -> str:
  """``path``'s text without its comments and docstrings (what runs)."""
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    body = getattr(node, "body", None)
    if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
      body[0] = ast.Pass()
  return ast.unparse(tree)


def test_the_time_model_tells_methods_apart_by_their_hooks_alone():
  """What a step synchronises is declared (``StepKind.sends``/``lands``, ``Method.parts``,
  ``lands_after``): the time model asks no attribute of a method's settings and imports no
  private method module."""
  path = ROOT / "compressors" / "step_time.py"
  assert "hasattr(" not in _code(path)
  assert not [m for m in _imported_modules(path, set(import_graph()))
              if any(part.startswith("_") for part in m.split("."))]


# The modules of the local-update methods themselves, where H is their own setting.
_LOCAL_UPDATE_MODULES = ("compressors/_local.py", "compressors/_streaming.py")


# The names a step kind's or a per-step input's ``every`` is read through (their own field).
_KIND_NAMES = {"k", "kind", "self", "inputs", "step_inputs", "exchange_inputs"}


def test_h_is_read_by_name_in_at_most_two_places_outside_the_local_update_modules():
  """A local-update method's H (its settings' ``every``) reaches the solver, the time model and
  the pages through ``Method.sends_every``/``with_sends_every``: ``x.every`` outside the
  local-update modules reads a step kind's or a per-step input's own field, but at most twice."""
  found = [f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}"
           for path in python_files() if not path.is_relative_to(ROOT / "tests")
           and path.relative_to(ROOT).as_posix() not in _LOCAL_UPDATE_MODULES
           for node in ast.walk(ast.parse(path.read_text()))
           if isinstance(node, ast.Attribute) and node.attr == "every"
           and not (isinstance(node.value, ast.Name) and node.value.id in _KIND_NAMES)]
  assert len(found) <= 2, found


def test_a_local_update_methods_carrier_is_read_through_its_hook():
  """Outside the local-update modules nothing reads a local-update method's carrier setting by
  name from its settings (``settings.carrier``; its old name ``settings.exchange``)."""
  found = [f"{path.relative_to(ROOT)}:{number}"
           for path in python_files() if not path.is_relative_to(ROOT / "tests")
           and path.relative_to(ROOT).as_posix() not in _LOCAL_UPDATE_MODULES
           for number, line in enumerate(path.read_text().splitlines(), 1)
           if re.search(r"\b(settings|own|solved)\.(carrier|exchange)\b", line.split("#")[0])]
  assert not found, found


def test_the_replica_check_follows_the_declared_landings():
  """The runner decides when to check replicas from what a kind declares it lands
  (``DataParallel.lands``), and checks what landed (``DataParallel.landed``), not from a
  method's options."""
  train = (ROOT / "experiments" / "train.py").read_text()
  assert "dp.lands(" in train and "dp.landed(" in train
  assert '"synchronise"' not in _code(ROOT / "compressors" / "parallel" / "data_parallel.py")


def test_tasc_imports_only_the_layers_below_the_registry():
  """tasc registers its method in the method table, as the registry adds the built-ins', and
  imports neither the registry nor the whole compressors package (whose ``__init__`` imports the
  registry), at any depth of the project's imports."""
  graph = import_graph()
  reached, todo = set(), [m for m in graph if m == "tasc" or m.startswith("tasc.")]
  while todo:
    module = todo.pop()
    for imported in graph.get(module, {}):
      if imported not in reached and not imported.startswith("tasc"):
        reached.add(imported)
        todo.append(imported)
  assert not reached & {"compressors", "compressors.registry"}, sorted(reached)


def test_look_alike_constants_are_named_by_what_they_hold():
  """``FAMILIES`` (the method families) and ``TIERS`` (the equal-bytes tiers) are each one
  module's; what a per-step method exchanges (``EXCHANGE_INPUTS``) is not named a letter away
  from the payloads' collectives (``protocol.EXCHANGES``)."""
  defined = {}
  for path in python_files():
    for node in ast.parse(path.read_text()).body:
      if isinstance(node, ast.Assign):
        for target in node.targets:
          if isinstance(target, ast.Name):
            defined.setdefault(target.id, []).append(path.relative_to(ROOT).as_posix())
  assert defined["FAMILIES"] == ["compressors/method_table.py"]
  assert defined["TIERS"] == ["compressors/equal_bytes.py"]
  assert "EXCHANGED" not in defined


# Each library layer and the layers it may import: experiments -> tasc -> optimizers ->
# compressors (configs, benchmarks and the tests above them all).
_LAYERS_BELOW = {"compressors": {"compressors"}, "optimizers": {"optimizers", "compressors"},
                 "tasc": {"tasc", "optimizers", "compressors"}}


def test_layers_import_only_downward():
  """No library layer imports one that wraps it; the embeddings' placement and exchange
  (communication, ``compressors/parallel/embeddings.py``) know no model and no data, and DLRM's
  model and data (``experiments/models/dlrm.py``, ``experiments/data/criteo.py``) no
  communication."""
  graph = import_graph()
  found = [f"{name} imports {module}" for name, imported in graph.items()
           for module in imported
           if name.split(".")[0] in _LAYERS_BELOW
           and module.split(".")[0] not in _LAYERS_BELOW[name.split(".")[0]]]
  found += [f"{name} imports {module}" for name in ("compressors.parallel.embeddings",
                                                    "compressors.parallel.hot_rows")
            for module in graph[name]
            if not module.startswith(("compressors.parallel", "compressors.network"))]
  found += [f"{name} imports {module}" for name in ("experiments.models.dlrm",
                                                    "experiments.data.criteo")
            for module in graph.get(name, {}) if module.startswith("compressors.parallel")]
  assert not found, "\n".join(found)


def test_the_embedding_codecs_reuse_the_methods_transports():
  """Issue 53: the embedding exchange's codecs (``compressors/embedding_codecs.py``) are the
  registered methods' transports (the 16-bit casts, the int8/int4 quantiser and its packing),
  not new ones; the placement and exchange (``compressors/parallel/embeddings.py``) know no
  codec, and the codecs live outside ``compressors/parallel``, which knows no method."""
  graph = import_graph()
  assert {"compressors._dense", "compressors._intq"} <= set(graph["compressors.embedding_codecs"])
  assert "compressors.embedding_codecs" not in graph["compressors.parallel.embeddings"]
  code = _code(ROOT / "compressors" / "embedding_codecs.py")
  found = [call for call in ("bitcast_convert_type", "def pack", "<< ") if call in code]
  assert not found, f"compressors/embedding_codecs.py packs payloads itself: {found}"


def test_placed_tables_train_in_the_one_data_parallel_step():
  """Issue 53: tables placed across devices extend the data-parallel step
  (``compressors.data_parallel(sharded=...)``), they do not bring a step of their own: the
  placed model and the sharded parameters' module build no program (no ``shard_map``, no
  ``jit``), and the runner builds its step at one call of ``compressors.data_parallel``."""
  found = [f"{path} builds a program ({call})"
           for path in ("experiments/models/placed_dlrm.py",
                        "compressors/parallel/sharded_params.py")
           for call in ("shard_map(", "jax.jit(", "pmap(")
           if call in (ROOT / path).read_text()]
  assert not found, "\n".join(found)
  assert (ROOT / "experiments/train.py").read_text().count("compressors.data_parallel(") == 1


def test_the_planner_of_runs_imports_the_library_the_fits_and_the_grid_s_config_only():
  """``experiments/plan.py`` reuses the cost and time models (``compressors``), the fits
  (``experiments.scaling``) and S1-LM's settings (``configs.paper.s1_lm``), and the command
  line's errors (``experiments.cli``); no runner module, and nothing imports it."""
  graph = import_graph()
  allowed = ("compressors", "configs.paper.s1_lm", "experiments.scaling", "experiments.cli")
  found = [m for m in graph["experiments.plan"] if not m.startswith(allowed)]
  assert not found, found
  assert not [name for name, imported in graph.items() if "experiments.plan" in imported]
