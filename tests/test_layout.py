"""The package's layers stay true: no import cycles, no import from a lower layer to a higher one.

Every import statement counts, inside functions too: a lazy import is still a dependency.
"""

import ast
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "transformer_jax"

# Lowest first. A module may import its own group and any group of a lower layer; groups in the
# same layer are independent of each other.
LAYERS = (
    ("transformer_jax.core",),
    ("transformer_jax.model", "transformer_jax.data"),
    ("transformer_jax.config",),
    ("transformer_jax.train",),
    ("transformer_jax.eval",),
    ("transformer_jax.tools",),
    ("transformer_jax.run", "transformer_jax.api", "transformer_jax.experiments"),
    ("transformer_jax.cli",),
    ("transformer_jax.__main__",),
)
# Modules held to a narrower rule: {module: the groups it may import}.
ONLY = {
    "transformer_jax": (),  # `import transformer_jax` must stay cheap and cycle-free
    "transformer_jax.model.config": ("transformer_jax.core",),  # the config knows no model code
}


def package_modules(root: pathlib.Path, folders: dict) -> dict:
  """{dotted module name: source path} for every .py file under the given folders.

  folders: {dotted package name: its directory}, e.g. the top-level experiments/ directory
  that installs as transformer_jax.experiments.
  """
  modules = {}
  for package, directory in folders.items():
    for path in sorted((root / directory).rglob("*.py")):
      parts = list(path.relative_to(root / directory).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      modules[".".join([package, *parts])] = path
  return modules


def imports_of(name: str, path: pathlib.Path, modules: dict) -> set:
  """The project modules that `name` imports (resolved to modules or packages that exist)."""
  is_package = path.name == "__init__.py"
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    targets = []
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative import
        anchor = name.split(".") if is_package else name.split(".")[:-1]
        anchor = anchor[:len(anchor) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      # `from pkg import module` names a module; `from module import function` names its module.
      targets = [f"{base}.{alias.name}" for alias in node.names]
    for target in targets:
      while target and target not in modules:
        target = target.rpartition(".")[0]
      # A package's __init__ runs before any of its modules anyway: that edge is no dependency.
      if target and target != name and not name.startswith(target + "."):
        found.add(target)
  return found


def group_of(module: str):
  for rank, groups in enumerate(LAYERS):
    for group in groups:
      if module == group or module.startswith(group + "."):
        return rank, group
  return None


def violations(graph: dict) -> list:
  """Every import that goes up a layer, sideways between groups, or breaks an ONLY rule."""
  problems = []
  for module, targets in sorted(graph.items()):
    if module in ONLY:
      allowed = ONLY[module]
      for target in sorted(targets):
        if not any(target == g or target.startswith(g + ".") for g in allowed):
          problems.append(f"{module} imports {target} (it may import only {allowed or 'nothing'})")
      continue
    here = group_of(module)
    if here is None:
      problems.append(f"{module} is in no layer: add it to LAYERS")
      continue
    for target in sorted(targets):
      there = group_of(target)
      if target == PACKAGE or there is None or there[1] == here[1]:
        continue
      if there[0] >= here[0]:
        problems.append(f"{module} (layer {here[0]}, {here[1]}) imports {target} "
                        f"(layer {there[0]}, {there[1]})")
  return problems


def cycles(graph: dict) -> list:
  """The strongly connected components of more than one module (Tarjan's algorithm)."""
  index, low, on_stack, stack, found = {}, {}, set(), [], []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for target in graph.get(node, ()):
      if target not in index:
        visit(target)
        low[node] = min(low[node], low[target])
      elif target in on_stack:
        low[node] = min(low[node], index[target])
    if low[node] == index[node]:
      component = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return found


def import_graph(root: pathlib.Path, folders: dict) -> dict:
  modules = package_modules(root, folders)
  return {name: imports_of(name, path, modules) for name, path in modules.items()}


PROJECT = {PACKAGE: PACKAGE, f"{PACKAGE}.experiments": "experiments"}


def test_the_package_has_no_import_cycle():
  assert cycles(import_graph(ROOT, PROJECT)) == []


def test_no_module_imports_from_a_higher_layer():
  graph = import_graph(ROOT, PROJECT)
  assert len(graph) > 40  # every module was found
  assert violations(graph) == []


def test_the_checks_catch_an_upward_import_and_a_cycle(tmp_path):
  """The same checks on a copy of the package with a deliberate upward import (the model reading
  the training loop) and a cycle (the loop importing the model back) both report it."""
  for directory in PROJECT.values():
    for path in (ROOT / directory).rglob("*.py"):
      copy = tmp_path / directory / path.relative_to(ROOT / directory)
      copy.parent.mkdir(parents=True, exist_ok=True)
      copy.write_text(path.read_text())
  layers = tmp_path / PACKAGE / "model" / "layers.py"
  upward = "\n\ndef _f():\n  from transformer_jax.train import loop\n"
  layers.write_text(layers.read_text() + upward)
  graph = import_graph(tmp_path, PROJECT)
  assert any("transformer_jax.model.layers" in p and "transformer_jax.train.loop" in p
             for p in violations(graph))
  assert any({"transformer_jax.model.layers", "transformer_jax.train.loop"} <= set(c)
             for c in cycles(graph))


def test_the_library_reaches_nothing_outside_its_package():
  """No path into the checkout around the package (launch.py, benchmarks/, the repo root)."""
  for path in (ROOT / PACKAGE).rglob("*.py"):
    text = path.read_text()
    for outside in ("launch.py", "benchmarks/", "from benchmarks", "sys.path", "os.pardir"):
      if path.name != "cli.py" or outside != "launch.py":  # cli.py names the checkout's wrapper
        assert outside not in text, f"{path.relative_to(ROOT)} mentions {outside!r}"
    assert text.count("os.path.dirname(os.path.dirname(") == 0, path
  assert os.path.isfile(ROOT / "experiments" / "__init__.py")
