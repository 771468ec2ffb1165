"""Find the code blocks of the project's Markdown pages and the marker each one carries.

A fenced block is ``python``, ``bash`` or ``sh`` code. The HTML comment on the line before it (blank lines
skipped) says how tests treat it:

* none: it runs on the CPU, and tests/test_docs.py runs it;
* ``<!-- gpu-only -->``: it needs GPUs (or several GPU machines); its fine-tune commands are validated with
  ``--check`` and its Python is compiled;
* ``<!-- multinode-demo -->``: the two-agent ``torchrun`` command that tests/test_multinode.py runs;
* ``<!-- not-run: REASON -->``: one of :data:`NOT_RUN_REASONS` (what no test may do).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_LANGS = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
MARKERS = ("gpu-only", "multinode-demo", "not-run")
NOT_RUN_REASONS = {
    "the test suite itself (CI runs it through .ci/run)",
    "installs packages",
}
_MARKER = re.compile(r"^<!--\s*([a-z-]+)(?::\s*(.*?))?\s*-->$")


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str  # "python" or "bash"
    code: str
    marker: str | None  # one of MARKERS, or None: runs on the CPU
    reason: str | None = None  # for not-run

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_pages() -> list[Path]:
    """The Markdown pages whose snippets are the project's documentation."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
            ROOT / "benchmarks" / "KERNEL_NOTES.md"]


def snippets(path: Path) -> list[Snippet]:
    """Every python/bash code block of ``path``, in order."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        body = "\n".join(lines[start + 1:i]) + "\n"
        i += 1
        if lang not in CODE_LANGS:
            continue
        marker = reason = None
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        mm = _MARKER.match(lines[j].strip()) if j >= 0 else None
        if mm:
            marker, reason = mm.group(1), mm.group(2)
        out.append(Snippet(path, start + 1, CODE_LANGS[lang], body, marker, reason))
    return out


def all_snippets() -> list[Snippet]:
    return [s for page in doc_pages() if page.exists() for s in snippets(page)]


def commands(code: str) -> list[str]:
    """The logical lines of a shell block: continuations joined, comments and blank lines dropped."""
    out, current = [], ""
    for raw in code.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        text = current.strip()
        current = ""
        if text and not text.startswith("#"):
            out.append(text)
    return out


def split_command(command: str) -> list[str]:
    """shlex tokens of one command, without a trailing comment."""
    return shlex.split(command, comments=True)


def namespace(model_dir: str, out_dir: str) -> dict:
    """What the documented snippets assume exists (the README's ``MODEL``, ``OUT``, ``dataset``,
    ``text_dataset``, ``loader``): the same on every rank, a few steps of data each."""
    import datasets
    import torch

    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(4, 128, (64,), generator=g).tolist() for _ in range(2)]
    dataset = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows}).with_format("torch")
    texts = [" ".join(f"t{int(t)}" for t in torch.randint(4, 128, (int(n),), generator=g))
             for n in torch.randint(8, 40, (6,), generator=g)]
    return {"MODEL": model_dir, "OUT": out_dir, "dataset": dataset,
            "text_dataset": datasets.Dataset.from_dict({"text": texts}),
            "loader": torch.utils.data.DataLoader(dataset, batch_size=1)}
