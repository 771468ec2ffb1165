"""What the GPU-only code (``scripts/``, ``tests/gpu/``) uses of the library still exists, and is public.

Read from the source, never run (most of it needs GPUs):
* every ``lightseq_hf`` name they import, reach by attribute, patch or name in a string resolves, so
  renaming or removing one fails here;
* no name of the library beginning with ``_`` outside ``lightseq_hf._testing``, the one internal surface
  (docs/design.md), and no private attribute of anything but their own objects and other libraries;
* no library attribute rebound, except by ``monkeypatch`` or by a context manager that restores it;
* a subprocess's ``PYTHONPATH`` extends the caller's;
* the shell runners (``scripts/*.sh``): every script, option, path and fine-tune override they pass exists.

The hooks of ``lightseq_hf._testing`` those files use run here too.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import shlex
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = sorted([*(ROOT / "scripts").rglob("*.py"), *(ROOT / "tests" / "gpu").glob("*.py")])
RUNNERS = sorted((ROOT / "scripts").glob("*.sh"))
SURFACE = "lightseq_hf._testing"
#: scripts whose command line is another module's parser
OPTIONS_FROM = {"finetune.py": ROOT / "lightseq_hf" / "training" / "cli.py"}
DOTTED = re.compile(r"\blightseq_hf(?:\.\w+)+")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# ----------------------------------------------------------------------------- names in Python files


@dataclass(frozen=True)
class Use:
    where: str
    name: str  # dotted, from lightseq_hf


def _bindings(tree: ast.Module) -> tuple[dict[str, str], set[str]]:
    """Local names bound to the library (name -> dotted path) and to other imports."""
    library, others = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "lightseq_hf":
                    library[a.asname or "lightseq_hf"] = a.name if a.asname else "lightseq_hf"
                else:
                    others.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            from_library = node.level == 0 and (node.module or "").split(".")[0] == "lightseq_hf"
            for a in node.names:
                if from_library:
                    library[a.asname or a.name] = f"{node.module}.{a.name}"
                else:
                    others.add(a.asname or a.name)
    return library, others


def _chain(node: ast.AST) -> tuple[ast.AST, list[str]]:
    """``a.b.c`` -> (the node of ``a``, ["b", "c"])."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return node, attrs[::-1]


def _library_name(node: ast.AST, library: dict[str, str]) -> str | None:
    """The dotted library name an expression ``a.b.c`` denotes (None: not rooted at the library)."""
    root, attrs = _chain(node)
    if isinstance(root, ast.Name) and root.id in library:
        return ".".join([library[root.id], *attrs])
    return None


def _parents(tree: ast.Module) -> dict[ast.AST, ast.AST]:
    return {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}


def library_uses(path: Path) -> list[Use]:
    """Every library name ``path`` imports, reaches by attribute, patches by name, or spells in a string."""
    tree = ast.parse(path.read_text())
    library, _ = _bindings(tree)
    parents = _parents(tree)
    uses = []

    def add(node: ast.AST, name: str) -> None:
        uses.append(Use(f"{path.name}:{node.lineno}", name))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "lightseq_hf":
                    add(node, a.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and \
                (node.module or "").split(".")[0] == "lightseq_hf":
            for a in node.names:
                add(node, f"{node.module}.{a.name}")
        elif isinstance(node, ast.Attribute) and not isinstance(parents.get(node), ast.Attribute):
            if (name := _library_name(node, library)) is not None:
                add(node, name)
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            target = _library_name(node.args[0], library)
            if func in ("setattr", "getattr", "hasattr", "delattr") and target is not None:
                add(node, f"{target}.{node.args[1].value}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            uses += [Use(f"{path.name}:{node.lineno}", m) for m in DOTTED.findall(node.value)
                     if DOTTED.fullmatch(node.value) or node.value.startswith(("import ", "from "))]
    return uses


def resolve(name: str) -> str | None:
    """None when the dotted ``name`` exists (a module, or attributes down from one), else why not."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[: i + 1]))
            continue
        except ModuleNotFoundError as err:
            if err.name != ".".join(parts[: i + 1]):
                return None  # the module exists; a package it needs is not installed here
        if isinstance(obj, type) and (part in _declared_fields(obj)):
            return None  # an instance attribute the class declares; nothing below it is checked
        return f"{'.'.join(parts[:i])} has no attribute {part!r}"
    return None


def _declared_fields(cls: type) -> set[str]:
    names = {f.name for f in fields(cls)} if is_dataclass(cls) else set()
    for klass in cls.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
    return names


def _all_uses() -> list[Use]:
    uses = [use for path in SCANNED for use in library_uses(path)]
    for runner in RUNNERS:
        for n, line in enumerate(runner.read_text().splitlines(), 1):
            uses += [Use(f"{_rel(runner)}:{n}", m) for m in DOTTED.findall(line)]
    return uses


def test_every_library_name_the_gpu_code_uses_exists():
    uses = _all_uses()
    assert len({u.name for u in uses}) > 40, "the scan found too few names: is it still reading the files?"
    missing = sorted(f"{u.where}: {u.name}: {why}" for u in uses if (why := resolve(u.name)))
    assert not missing, "\n".join(missing)


def test_gpu_code_uses_no_private_library_name_outside_the_internal_surface():
    private = sorted(f"{u.where}: {u.name}" for u in _all_uses() if not u.name.startswith(SURFACE + ".")
                     and u.name != SURFACE and any(_is_private(p) for p in u.name.split(".")))
    assert not private, "reach it through lightseq_hf._testing:\n" + "\n".join(private)


def _own_names(tree: ast.Module) -> set[str]:
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_gpu_code_reads_no_private_attribute_of_objects_it_does_not_own():
    """``x._y`` only for ``self``/``cls``, the file's own functions and classes, and other libraries."""
    found = []
    for path in SCANNED:
        tree = ast.parse(path.read_text())
        library, others = _bindings(tree)
        allowed = others | _own_names(tree) | {"self", "cls"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                root, _ = _chain(node)
                if not (isinstance(root, ast.Name) and root.id in allowed and root.id not in library):
                    found.append(f"{_rel(path)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


def _restored_in_finally(function: ast.FunctionDef) -> set[str]:
    """Targets a ``@contextmanager`` function assigns again in a ``finally`` block."""
    if not any("contextmanager" in ast.unparse(d) for d in function.decorator_list):
        return set()
    return {ast.unparse(t) for node in ast.walk(function) if isinstance(node, ast.Try)
            for stmt in node.finalbody for sub in ast.walk(stmt) if isinstance(sub, ast.Assign)
            for t in sub.targets}


def rebinding_problems(paths: list[Path]) -> list[str]:
    """Library attributes rebound outside a context manager that restores them."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text())
        library, _ = _bindings(tree)
        scoped = {id(node): _restored_in_finally(f) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                  for node in ast.walk(f)}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "delattr"):
                targets = node.args[:1]
            for target in targets:
                if isinstance(target, ast.Name) or _library_name(target, library) is None:
                    continue
                if ast.unparse(target) not in scoped.get(id(node), set()):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_gpu_code_rebinds_no_library_attribute_unless_scoped():
    """Patches go through ``monkeypatch`` (``MonkeyPatch.context()`` in spawned workers) or a context
    manager that restores what it replaced."""
    found = rebinding_problems(SCANNED)
    assert not found, "\n".join(found)


def pythonpath_problems(paths: list[Path]) -> list[str]:
    """Subprocess environments whose ``PYTHONPATH`` does not read the caller's."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            values = []
            if isinstance(node, ast.keyword) and node.arg == "PYTHONPATH":
                values.append(node.value)
            elif isinstance(node, ast.Dict):
                values += [v for k, v in zip(node.keys, node.values)
                           if isinstance(k, ast.Constant) and k.value == "PYTHONPATH"]
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript) and \
                    "PYTHONPATH" in ast.unparse(node.targets[0].slice):
                values.append(node.value)
            found += [f"{path.name}:{node.lineno}: {ast.unparse(v)}" for v in values
                      if "PYTHONPATH" not in ast.unparse(v)]
    return found


def test_subprocesses_extend_the_callers_pythonpath():
    found = pythonpath_problems(SCANNED)
    assert not found, "\n".join(found)


def test_the_scan_sees_what_it_checks(tmp_path):
    """The checks above on a file with one of each problem."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os, subprocess\nimport lightseq_hf\nfrom lightseq_hf.parallel import ops\n"
                   "from lightseq_hf.kernels import no_such_name\n"
                   "ops.BACKWARD_CHUNK_BYTES = 1\nx = lightseq_hf.kernels.no_such_attribute\n"
                   "subprocess.run([], env=dict(os.environ, PYTHONPATH='.'))\n")
    names = {u.name for u in library_uses(bad)}
    assert {"lightseq_hf.kernels.no_such_name", "lightseq_hf.kernels.no_such_attribute",
            "lightseq_hf.parallel.ops.BACKWARD_CHUNK_BYTES"} <= names
    assert resolve("lightseq_hf.kernels.no_such_name") and resolve("lightseq_hf.kernels.no_such_attribute")
    assert resolve("lightseq_hf.parallel.ops.BACKWARD_CHUNK_BYTES") is None
    assert rebinding_problems([bad]) == ["bad.py:5: ops.BACKWARD_CHUNK_BYTES = 1"]
    assert len(pythonpath_problems([bad])) == 1


# ----------------------------------------------------------------------------- shell runners


class ShellScanner:
    """Walks shell text keeping its quoting contexts: ``'``, ``"``, ``$(`` (command substitution), ``(``
    inside one, ``${`` (parameter expansion)."""

    def __init__(self, text: str) -> None:
        self.text, self.stack, self.i = text.replace("\\\n", " "), [], 0

    def step(self) -> str:
        """The next character (or ``$(`` / ``${``), after which the context stack is updated."""
        text, i, top = self.text, self.i, self.stack[-1] if self.stack else None
        c, two = text[i], text[i:i + 2]
        if top == "'":
            if c == "'":
                self.stack.pop()
        elif c == "\\":
            c = two
        elif two in ("$(", "${"):
            self.stack.append(two)
            c = two
        elif top == '"':
            if c == '"':
                self.stack.pop()
        elif top == "${":
            if c == "}":
                self.stack.pop()
        elif c in "'\"":
            self.stack.append(c)
        elif c == "(" and top in ("$(", "("):
            self.stack.append(c)
        elif c == ")" and top in ("$(", "("):
            self.stack.pop()
        self.i = i + len(c)
        return c

    def done(self) -> bool:
        return self.i >= len(self.text)


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell script, as words (quotes removed, ``$...`` left as written): split at
    newlines, ``;``, ``|``, ``&`` and parentheses outside quotes; comments dropped; a command substitution
    ``$(...)`` is a word ``$_`` of its command and its own commands come after."""
    scan, pieces, inner, current, opened, substitution = ShellScanner(text), [], [], [], None, 0
    while not scan.done():
        depth, start = len(scan.stack), scan.i
        c = scan.step()
        if opened is not None:
            if len(scan.stack) < opened:  # the outermost substitution closed
                inner.append(scan.text[substitution:start])
                opened = None
            continue
        if c == "$(" and "$(" not in scan.stack[:-1]:
            opened, substitution = len(scan.stack), scan.i
            current.append("$_")
        elif depth == 0 and c == "#" and (not current or current[-1] in " \t"):
            while not scan.done() and scan.text[scan.i] != "\n":
                scan.i += 1
        elif depth == 0 and c in "\n;|&()":
            pieces.append("".join(current))
            current = []
        else:
            current.append(c)
    pieces.append("".join(current))
    words = [shlex.split(p) for p in pieces if p.strip()]
    commands = [[w for w in cmd if w not in ("{", "}")] for cmd in words]
    return [cmd for cmd in commands if cmd] + [cmd for text in inner for cmd in shell_commands(text)]


def _command_word(cmd: list[str]) -> str | None:
    for word in cmd:
        if re.fullmatch(r"\w+=.*", word) or word in ("then", "do", "else", "exec", "!", "time"):
            continue
        return word
    return None


def _function_bodies(text: str) -> dict[str, str]:
    """``name() { ... }`` -> body (its braces matched outside quotes, substitutions and ``${...}``)."""
    bodies, text = {}, ShellScanner(text).text
    for m in re.finditer(r"^\s*([\w-]+)\(\)\s*\{", text, flags=re.M):
        scan, depth = ShellScanner(text), 1
        scan.i = m.end()
        while depth and not scan.done():
            outside = not scan.stack
            c = scan.step()
            if outside and c in "{}":
                depth += 1 if c == "{" else -1
        bodies[m.group(1)] = scan.text[m.end(): scan.i - 1]
    return bodies


def _arrays(text: str) -> dict[str, list[str]]:
    """``name=(words)`` -> the words (the closing parenthesis found outside quotes and expansions)."""
    arrays, text = {}, ShellScanner(text).text
    for m in re.finditer(r"(\w+)=\(", text):
        scan = ShellScanner(text)
        scan.i, scan.stack = m.end(), ["("]
        while scan.stack and not scan.done():
            scan.step()
        arrays[m.group(1)] = shlex.split(text[m.end(): scan.i - 1])
    return arrays


def _expand(words: list[str], arrays: dict[str, list[str]]) -> list[str]:
    out = []
    for w in words:
        m = re.fullmatch(r"\$\{(\w+)\[[@*]\]\}", w)
        out += arrays.get(m.group(1), []) if m else [w]
    return out


def _script_calls(text: str) -> list[tuple[str, list[str]]]:
    """(script, the words after it) of every run of a ``scripts/*.py``, direct or through a shell function
    that passes its arguments on (``"$@"``)."""
    arrays, bodies = _arrays(text), _function_bodies(text)
    forwards: dict[str, tuple[str, list[str]]] = {}  # function -> (script, words its body adds)
    for _ in range(3):  # functions calling functions
        for name, body in bodies.items():
            for cmd in shell_commands(body):
                cmd = _expand(cmd, arrays)
                at = next((i for i, w in enumerate(cmd) if re.fullmatch(r"(\S*/)?scripts/\w+\.py", w)), None)
                if at is not None and "$@" in cmd[at:]:
                    forwards[name] = (Path(cmd[at]).name, [w for w in cmd[at + 1:] if w != "$@"])
                elif _command_word(cmd) in forwards and "$@" in cmd and name not in forwards:
                    script, extra = forwards[_command_word(cmd)]
                    forwards[name] = (script, extra + [w for w in cmd[1:] if w != "$@"])
    calls = []
    for cmd in shell_commands(text):
        cmd = _expand(cmd, arrays)
        for i, w in enumerate(cmd):
            if re.fullmatch(r"(\S*/)?scripts/\w+\.py", w):
                calls.append((Path(w).name, cmd[i + 1:]))
        word = _command_word(cmd)
        if word in forwards:
            script, extra = forwards[word]
            calls.append((script, cmd[cmd.index(word) + 1:] + extra))
    return calls


def script_options(script: str) -> set[str]:
    """The option strings of a script's argparse parser, read from its ``add_argument`` calls."""
    source = OPTIONS_FROM.get(script, ROOT / "scripts" / script)
    options = {"-h", "--help"}
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            options |= {a.value for a in node.args
                        if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return options


def _config_overrides(words: list[str]) -> tuple[str, list[str]] | None:
    config = next((w for w in words if re.fullmatch(r"configs/[\w.-]+\.yaml", w)), None)
    if config is None:
        return None
    return config, [w for w in words if re.fullmatch(r"[\w.]+=[^$]*", w) and "$" not in w]


def runner_problems(text: str) -> list[str]:
    """Paths, scripts, options and fine-tune overrides of a shell runner that do not exist."""
    from lightseq_hf.training.config import load_config
    from lightseq_hf.training.errors import ConfigError

    problems = []
    for cmd in shell_commands(text):
        for word in cmd:
            if re.fullmatch(r"(scripts|tests|configs|benchmarks|docs|lightseq_hf)/[\w./-]+", word) and \
                    not (ROOT / word).exists():
                problems.append(f"{word}: no such path")
    for script, words in _script_calls(text):
        if not (ROOT / "scripts" / script).is_file():
            problems.append(f"scripts/{script}: no such script")
            continue
        options = script_options(script)
        flags = [f for w in words for f in re.findall(r"(?:^|:[+-])(--[a-z][\w-]*)", w)]  # ${x:+--flag}
        problems += [f"scripts/{script} {f}: no such option" for f in flags if f not in options]
        if script == "finetune.py" and (found := _config_overrides(words)):
            try:
                load_config(ROOT / found[0], found[1])
            except ConfigError as err:
                problems.append(f"scripts/{script} {found[0]} {' '.join(found[1])}: {err}")
    return sorted(set(problems))


@pytest.mark.parametrize("runner", RUNNERS, ids=lambda p: p.name)
def test_shell_runner_commands_resolve(runner):
    problems = runner_problems(runner.read_text())
    assert not problems, "\n".join(problems)


def test_shell_parsing_finds_the_runs_it_checks():
    text = (ROOT / "scripts" / "run_gpu_benchmarks.sh").read_text()
    calls = _script_calls(text)
    train = [words for script, words in calls if script == "bench_train.py"]
    assert any("--search-max-context" in w and "--time-budget" in w for w in train)  # maxctx -> train
    assert any("--device-order" in w for script, w in calls if script == "bench_dist_attn.py")
    assert any("--no-ablations" in w for script, w in calls if script == "bench_dist_attn.py")  # an array
    finetune = _script_calls((ROOT / "scripts" / "run_gpu_finetune.sh").read_text())
    assert any(s == "finetune.py" and _config_overrides(w) and "saving.final=false" in w for s, w in finetune)
    assert "--seqs" in script_options("bench_train.py") and "--nproc" in script_options("finetune.py")


# ----------------------------------------------------------------------------- the internal surface


def test_internal_surface_hooks_run_on_the_cpu():
    import torch

    from lightseq_hf._testing import kernel_knobs, trainer_variants, views
    from lightseq_hf.offload import HostBufferPool, OffloadStats
    from lightseq_hf.training import build, loop

    if importlib.util.find_spec("triton") is not None:
        kernels = kernel_knobs.triton_kernels()
        assert set(kernels) == {*kernel_knobs.AUTOTUNED, "delta"}
        assert all(kernels[k].configs and kernels[k].fn.arg_names for k in kernel_knobs.AUTOTUNED)
        assert "Delta" in kernels["delta"].arg_names
    assert kernel_knobs.cudnn_backward_fell_back() is False

    pool = HostBufferPool(OffloadStats(), pin=False)
    held = pool.take(torch.Size([4, 2]), torch.float32)
    assert views.pooled_host_buffers(pool) == []
    pool.give_back(held)
    (buffer,) = views.pooled_host_buffers(pool)
    assert buffer.numel() == 32 and buffer.data_ptr() == held.data_ptr()

    model = torch.nn.Linear(2, 2)
    with trainer_variants.keep_parameter_lists() as kept:
        assert loop.build_optimizer is not build.build_optimizer
        cfg = _tiny_config()
        loop.build_optimizer(model, cfg, 4)
        assert kept == list(model.parameters())
    assert loop.build_optimizer is build.build_optimizer

    from accelerate.utils import DistributedType

    trainer = loop.Trainer.__new__(loop.Trainer)
    calls = []
    accelerator = type("Accelerator", (), {"no_sync": lambda self, m: calls.append(m),
                                           "distributed_type": DistributedType.FSDP})()
    trainer.model, trainer.accelerator = model, accelerator
    with trainer_variants.no_sync_until_last_micro_batch():
        trainer._gradient_sync(last=False)
        trainer._gradient_sync(last=True)
        assert calls == [model]  # under FSDP too
    trainer._gradient_sync(last=False)  # restored: FSDP reduces every micro-batch
    assert calls == [model]


def _tiny_config():
    from lightseq_hf.training.config import load_config

    return load_config(ROOT / "configs" / "tiny.yaml", ["output_dir=/nonexistent"])


def test_gpu_script_runs_pass_options_that_exist():
    """The argument lists tests/gpu/test_scripts_gpu.py starts the scripts with."""
    from test_script_smoke import gpu_script_runs

    problems = [f"{run.script} {arg}" for run in gpu_script_runs() for arg in run.args
                if arg.startswith("--") and arg not in script_options(run.script)]
    assert not problems, problems


def test_shell_check_finds_what_does_not_exist():
    text = """train() { local limit=$1; shift
  run timeout "$limit" torchrun scripts/bench_train.py --out "$out" "$@" 2>&1 | cut -c1-400; }
train 100 --seqs 1 --no-such-flag  # a comment --not-a-flag
python3 scripts/no_such_script.py && echo "$(ls configs/no-such.yaml)"
accelerate launch scripts/finetune.py configs/tiny.yaml training.no_such_key=1
"""
    problems = runner_problems(text)
    assert [p.split(": ")[0] for p in problems] == [
        "configs/no-such.yaml", "scripts/bench_train.py --no-such-flag",
        "scripts/finetune.py configs/tiny.yaml training.no_such_key=1", "scripts/no_such_script.py",
        "scripts/no_such_script.py"], problems


# ----------------------------------------------------------------------------- scripts run from a checkout

ENTRY_POINTS = sorted(p for p in (ROOT / "scripts").glob("*.py"))
_FROM_A_CHECKOUT = """
import runpy, sys
# the GPU machines run scripts from a checkout, with no installed lightseq_hf: drop the editable install's
# finder and the package's modules, then run the script as `python scripts/NAME.py --help` would
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
sys.path[:] = [p for p in sys.path if p not in ("", ROOT)]
sys.path.insert(0, SCRIPTS)
sys.argv = [SCRIPT, "--help"]
try:
    runpy.run_path(SCRIPT, run_name="__main__")
except SystemExit:
    pass
if USES_PACKAGE:
    import lightseq_hf
    assert lightseq_hf.__file__.startswith(ROOT), lightseq_hf.__file__
"""


def _imports_package(script: Path) -> bool:
    """Whether the script imports ``lightseq_hf`` or ``benchlib`` anywhere (at its top or once it runs)."""
    for node in ast.walk(ast.parse(script.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n.split(".")[0] in ("lightseq_hf", "benchlib") for n in names):
            return True
    return False


@pytest.mark.parametrize("script", ENTRY_POINTS, ids=lambda p: p.name)
def test_scripts_find_the_package_when_run_from_a_checkout(script, tmp_path):
    """A script run as ``python scripts/NAME.py --help`` in a checkout that was never installed (the GPU
    machines) runs, and one that uses ``lightseq_hf`` finds this checkout's, also where it imports it only
    once it runs."""
    import subprocess
    import sys

    prelude = (f"ROOT, SCRIPTS, SCRIPT = {str(ROOT)!r}, {str(script.parent)!r}, {str(script)!r}\n"
               f"USES_PACKAGE = {_imports_package(script)}\n")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    done = subprocess.run([sys.executable, "-c", prelude + _FROM_A_CHECKOUT], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
