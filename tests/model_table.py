"""The tables of supported and refused model types (``docs/models.md``, one row per model type, and the
README's summary of it): what each row says, rendered and parsed.

A row is one causal-LM model type of Transformers: ``works`` (the worst relative errors of the
architecture test on 2 and 3 processes, or of the survey on 2 processes for the types the test does not
run), ``refused`` (the message :func:`lightseq_hf.patch` gives), or ``not run`` (accepted by the
patch's checks, no tiny model of it ran). ``scripts/support_table.py`` measures and rewrites the table
(and ``benchmarks/results/architectures.json``, its data); ``tests/test_architectures.py`` checks it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MODELS_PAGE = ROOT / "docs" / "models.md"
RESULTS = ROOT / "benchmarks" / "results" / "architectures.json"
START, END = "<!-- support-table:start -->", "<!-- support-table:end -->"
COLUMNS = ("model type", "status", "parity", "memory options")


def describe_meta(model_type: str, overrides: dict | None = None, *, tiny: bool = True):
    """``(architecture, None)`` or ``(None, refusal message)`` of a model built on the meta device."""
    from tiny_models import causal_lm_class, make_tiny

    from lightseq_hf.patches import UnsupportedModel, describe

    with torch.device("meta"):
        if tiny:
            model = make_tiny(model_type, **(overrides or {}))
        else:
            import transformers

            model = causal_lm_class(model_type)(transformers.CONFIG_MAPPING[model_type]())
    try:
        return describe(model), None, model
    except UnsupportedModel as refused:
        return None, str(refused), model


def refusal_message(model_type: str, overrides: dict | None = None) -> str:
    """The refusal without its ``lightseq_hf cannot patch X (model_type 'y'):`` prefix."""
    _, message, _ = describe_meta(model_type, overrides)
    return short_message(message)


def short_message(message: str) -> str:
    return message.split("): ", 1)[1] if "): " in message else message


def memory_options(model) -> str:
    """What the memory options do for this model (as ``lightseq_hf.patch`` applies them)."""
    from lightseq_hf.patches import describe
    from lightseq_hf.patches.tiled_mlp import layer_mlps

    dense, other = layer_mlps(model)
    tiled = ("tiled MLP" if dense and not other else "tiled MLP (dense layers; MoE untiled)" if dense
             else "no tiled MLP (MoE or untileable MLP)" if other else "no MLP module: no tiled MLP")
    loss = "fused loss" if describe(model).fused_head else "model's head on the slice"
    checkpointing = ("remat checkpointing, offload" if model.supports_gradient_checkpointing
                     else "no checkpointing (the model has none)")
    return f"{checkpointing}, {tiled}, {loss}"


def expected_row(model_type: str, overrides: dict | None = None) -> dict:
    arch, message, model = describe_meta(model_type, overrides)
    if arch is None:
        return {"model type": model_type, "status": "refused", "parity": short_message(message),
                "memory options": "-"}
    return {"model type": model_type, "status": "works", "memory options": memory_options(model)}


def format_numbers(numbers: dict, dtype: str, source: str) -> str:
    parts = [f"{name} {numbers[key]:.1e}" for key, name in (("loss", "loss"), ("grad", "gradients"),
                                                           ("aux", "aux loss")) if key in numbers]
    return f"{', '.join(parts)} ({dtype}, {source})"


INTRO = """\
`lightseq_hf.patch(model)` serves every decoder-only causal LM of Transformers whose layers attend
through Transformers' `AttentionInterface` with full, sliding-window or chunked causal attention; it
finds the decoder stack, the layers and the head from the model itself. Anything else is refused when
the model is patched, with the feature and the model type named. Every causal-LM model type of
Transformers {transformers} is below: `works` with the worst relative errors against the unpatched
model on one process (loss, router aux loss, every parameter's gradient) measured by
`tests/test_architectures.py` on 2 and 3 CPU processes (or by its survey on 2, for the types the test
does not run), `refused` with the message, `not run` when the patch accepts it but no tiny model of
it ran. Regenerate with `python scripts/support_table.py --survey` (data:
`benchmarks/results/architectures.json`).
"""


SUMMARY_INTRO = """\
`lightseq_hf.patch(model)` finds the decoder stack, the layers and the head of any decoder-only causal LM
whose layers attend through Transformers' `AttentionInterface` (full, sliding-window or chunked causal
attention). Each causal-LM model type of Transformers {transformers}, patched on 2 (and for the test's
types 3) CPU processes against the unpatched model on one; [docs/models.md](docs/models.md) gives each
one's measured errors, refusal message and memory options."""

REFUSAL_KINDS = (  # (words of the refusal message, what the summary calls them)
    (("encoder-decoder",), "encoder-decoder"),
    (("bidirectional",), "bidirectional encoders"),
    (("linear-attention", "state-space", "sparse", "compressed"), "linear, sparse or state-space attention"),
    (("composite", "multimodal", "decoder stack"), "composite and multimodal models"),
    (("AttentionInterface",), "attention outside AttentionInterface"),
)


def refusal_kind(message: str) -> str:
    return next((name for words, name in REFUSAL_KINDS if any(w in message for w in words)), "other features")


def render_summary(rows: list[dict], transformers_version: str) -> str:
    """The README's summary: the model types that work, are refused (by kind of refusal), or did not run."""
    def names(selected: list[dict]) -> str:
        return ", ".join(f"`{row['model type']}`" for row in selected)

    works = [r for r in rows if r["status"] == "works"]
    refused = [r for r in rows if r["status"] == "refused"]
    not_run = [r for r in rows if r["status"] == "not run"]
    kinds = [name for _, name in REFUSAL_KINDS] + ["other features"]
    groups = [(kind, [r for r in refused if refusal_kind(r["parity"]) == kind]) for kind in kinds]
    lines = [SUMMARY_INTRO.format(transformers=transformers_version), "", "| status | model types |",
             "|---|---|", f"| works, exact ({len(works)}) | {names(works)} |"]
    lines += [f"| refused: {kind} ({len(group)}) | {names(group)} |" for kind, group in groups if group]
    if not_run:
        lines.append(f"| accepted, no tiny model ran ({len(not_run)}) | {names(not_run)} |")
    return "\n".join(lines)


def render(rows: list[dict], transformers_version: str) -> str:
    lines = [INTRO.format(transformers=transformers_version), "| " + " | ".join(COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [f"`{row['model type']}`", row["status"], row["parity"], row["memory options"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


_NUMBER = re.compile(r"(loss|gradients|aux loss) ([0-9.e+-]+)")


def table_between_markers(text: str) -> str:
    if START not in text or END not in text:
        raise ValueError(f"no support table between {START} and {END}.")
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n")


def parse_rows(page: str) -> list[dict]:
    """The rows of the table between the markers (``numbers``: what the parity cell states)."""
    body = table_between_markers(page)
    rows = []
    for line in [line for line in body.splitlines() if line.startswith("|")][2:]:
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        row = dict(zip(COLUMNS, cells))
        row["model type"] = row["model type"].strip("`")
        row["numbers"] = {name: float(value) for name, value in _NUMBER.findall(row["parity"])}
        rows.append(row)
    return rows


def replace_table(readme: str, table: str) -> str:
    head, rest = readme.split(START, 1)
    return head + START + "\n" + table + "\n" + END + rest.split(END, 1)[1]


def load_results() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
