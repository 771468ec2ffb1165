"""The library's shape rules: short functions and modules, kernels described by their contract (no
capability probes), no test switches read from the environment in production modules, no import cycles,
and modules that say what they export (tests reaching none of the rest)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from test_script_surface import library_uses

PACKAGE = Path(__file__).resolve().parent.parent / "lightseq_hf"
MAX_FUNCTION_LINES = 80  # outside @triton.jit bodies
MAX_MODULE_LINES = 500
#: where reading the environment is the point (launch, the process's rank, Triton's interpreter switch,
#: the launcher's WORLD_SIZE that tells a launch whose processes never joined a process group)
ENVIRONMENT_READERS = {"training/cli.py", "training/processes/launch.py", "training/build.py",
                       "kernels/triton_common.py", "parallel/groups.py"}
TESTS = Path(__file__).resolve().parent


def _modules() -> list[tuple[str, ast.Module, str]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        found.append((path.relative_to(PACKAGE).as_posix(), ast.parse(source), source))
    return found


def _is_jit(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(decorator) for decorator in node.decorator_list)


def test_functions_and_modules_are_short():
    long_functions, long_modules = [], []
    for name, tree, source in _modules():
        if source.count("\n") > MAX_MODULE_LINES:
            long_modules.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_jit(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long_functions, long_functions
    assert not long_modules, long_modules


def test_no_capability_probes_on_kernels():
    """Capabilities are declared (``kernel.capabilities``), never probed with ``getattr(kernel, ...)``."""
    probes = []
    for name, tree, _ in _modules():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in
                    ("getattr", "hasattr") and node.args and "kernel" in ast.unparse(node.args[0]).lower()):
                probes.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not probes, probes


def test_no_environment_switches_in_production_modules():
    """Test faults and kernel knobs live in ``lightseq_hf._testing``; production code reads no switches."""
    readers = []
    for name, tree, _ in _modules():
        if name.startswith("_testing/") or name in ENVIRONMENT_READERS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                readers.append(f"{name}:{node.lineno}")
    assert not readers, readers


def _module_name(relative: str) -> str:
    parts = ["lightseq_hf", *relative.removesuffix(".py").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(name: str, is_package: bool, tree: ast.Module, modules: set[str]) -> set[str]:
    """The package's modules that ``name`` imports, at its top or inside a function."""
    here = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in modules and m != name}


def test_no_import_cycles():
    """No module imports one that imports it back, directly or through others, even inside a function
    (an import deferred to break a circle still ties the two modules together)."""
    modules = {_module_name(name): (name, tree) for name, tree, _ in _modules()}
    graph = {m: _imports(m, name.endswith("__init__.py"), tree, set(modules)) for m, (name, tree) in
             modules.items()}

    def path_back(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = {" -> ".join(p) for m in graph if (p := path_back(m))}
    assert not cycles, sorted(cycles)[:5]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_names(body: list[ast.stmt]) -> list[tuple[str, int]]:
    """(name, line) of what a module's top level defines: functions, classes and assignment targets
    (constants, variables, type aliases), also inside a top-level ``if``, ``try`` or ``with``."""
    found = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.name, node.lineno))
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [(n.id, node.lineno) for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif isinstance(node, getattr(ast, "TypeAlias", ())):
            found.append((node.name.id, node.lineno))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            nested = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                      *(s for handler in getattr(node, "handlers", []) for s in handler.body)]
            found += _defined_names(nested)
    return found


def _declared_exports(tree: ast.Module) -> list[str] | None:
    """The module's ``__all__``, a literal list or tuple of names (None: it has none)."""
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            return list(ast.literal_eval(node.value))
    return None


def test_every_module_name_is_exported_or_private():
    """Each module declares ``__all__``; every name its top level defines is listed there or begins with
    ``_``; every listed name exists and none is private.

    What counts: functions, classes, constants, module-level variables and type aliases (an alias is a
    definition like any other: exported when another module spells it, else private). Dunder names
    (``__all__``, ``__version__``, a module ``__getattr__``) are Python's, not the module's. Imported names
    are the defining module's: they need neither, and a module re-exports one by listing it in ``__all__``
    (a package's ``__init__``, the planner's ``OffloadPlan``). Exported means used by another module of the
    package, by ``scripts/`` or by tests as the module's own contract (a pure function such as the
    schedule's), or documented as API; a name only its own module uses is private. The package's public
    API is ``lightseq_hf.__all__``; a module's ``__all__`` is what the rest of the code may use of it."""
    problems, checked = [], 0
    for name, tree, _ in _modules():
        checked += 1
        exported = _declared_exports(tree)
        if exported is None:
            problems.append(f"{name}: no __all__ (list what the module exports, [] if nothing)")
            continue
        problems += [f"{name}:{line} {n}: neither in __all__ nor _-prefixed"
                     for n, line in _defined_names(tree.body) if not n.startswith("_") and n not in exported]
        module = importlib.import_module(_module_name(name))
        problems += [f"{name}: __all__ lists {n!r}, " + ("private" if _is_private(n) else "not defined")
                     for n in exported if _is_private(n) or not hasattr(module, n)]
    assert checked > 60, f"only {checked} modules found under lightseq_hf/"
    assert not problems, "\n".join(problems)


def _owning_module(dotted: str, modules: dict[str, str]) -> str | None:
    """The relative path of the package module that ``dotted`` (``lightseq_hf.a.b.name``) is a name of."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if (relative := modules.get(".".join(parts[:end]))) is not None:
            return relative
    return None


def test_tests_use_no_private_name_of_a_package_module():
    """No file under ``tests/`` (``tests/gpu`` too: the rule is about tests, wherever they run) imports,
    reaches by attribute, patches by name or spells in a dotted string a ``_``-prefixed name of a package
    module, except through ``lightseq_hf._testing``, the one internal surface. (Private attributes of
    objects a test holds are not seen here: ``tests/test_script_surface.py`` reads those of the GPU-only
    code.)"""
    modules = {_module_name(name): name for name, _, _ in _modules()}
    uses = [use for path in sorted(TESTS.rglob("*.py")) for use in library_uses(path)]
    assert len(uses) > 300, "the scan found too few names: is it still reading the test files?"
    private = sorted({f"{use.where}: {use.name}" for use in uses
                      if not (use.name + ".").startswith("lightseq_hf._testing.")
                      and any(_is_private(part) for part in use.name.split(".")[1:])
                      and _owning_module(use.name, modules) is not None})
    assert not private, "use a public name or lightseq_hf._testing:\n" + "\n".join(private)
