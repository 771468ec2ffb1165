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
