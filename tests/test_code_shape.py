"""The library's shape rules: short functions and modules, kernels described by their contract (no
capability probes), no test switches read from the environment in production modules."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightseq_hf"
MAX_FUNCTION_LINES = 80  # outside @triton.jit bodies
MAX_MODULE_LINES = 500
#: where reading the environment is the point (launch, the process's rank, Triton's interpreter switch,
#: the launcher's WORLD_SIZE that tells a launch whose processes never joined a process group)
ENVIRONMENT_READERS = {"training/cli.py", "training/launch.py", "training/build.py",
                       "kernels/triton_common.py", "parallel/groups.py"}


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
