"""Measure the causal-LM model types of Transformers and rewrite the support tables (docs/models.md, README).

    python scripts/support_table.py            # the architecture test's types, on 2 and 3 processes
    python scripts/support_table.py --survey   # and every other type the patch accepts, on 2 (slow)
    python scripts/support_table.py --types llama --out /tmp/tables   # a few types, pages written to /tmp

Every causal-LM model type gets a row: ``works`` with the worst relative errors measured (the
architecture test's checks: loss, aux loss, every gradient, attention calls, tiles, offload), ``refused``
with the message ``lightseq_hf.patch`` gives, or ``not run`` (accepted, no tiny model of it ran). The
rows are also written to ``benchmarks/results/architectures.json`` (with the date and versions); numbers of
types
not re-measured are kept from it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import model_table as table  # noqa: E402
import test_architectures as arch_test  # noqa: E402


def _all_model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _verdict(model_type: str) -> dict:
    """The patch's verdict on a tiny model of the type (built on meta), else on its default config."""
    refused = model_type in arch_test.REFUSED and model_type not in arch_test.SUPPORTED
    overrides = arch_test.REFUSED[model_type][0] if refused else {}
    for tiny in (True, False):
        try:
            arch, message, model = table.describe_meta(model_type, overrides, tiny=tiny)
        except Exception as exc:  # noqa: BLE001  (a config that does not build with these values)
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            continue
        if arch is None:
            return {"status": "refused", "parity": table.short_message(message), "memory options": "-"}
        size = sum(p.numel() for p in model.parameters())
        return {"status": "not run", "parity": "accepted by the patch; no tiny model of it ran",
                "memory options": table.memory_options(model), "tiny": tiny and size <= 10_000_000}
    return {"status": "not run", "parity": f"its config does not build ({error})", "memory options": "-"}


def _merge(rows: dict, numbers: dict, failures: dict, source: str, cases) -> None:
    for model_type, packed in cases:
        found = numbers.get((model_type, packed))
        row = rows[model_type]
        found_failures = failures.get((model_type, packed), [])
        if found_failures and "reference raised" in found_failures[0]:
            row.update(parity="accepted by the patch; its tiny model does not run unpatched ("
                       + found_failures[0].split("reference raised ", 1)[1] + ")")
            continue
        refusal = f"raised ValueError: {model_type}: "
        if found_failures and refusal in found_failures[0]:  # refused by name at its first step
            message = found_failures[0].split(refusal, 1)[1]
            row.update(status="refused", parity=f"at the first step: {message}", **{"memory options": "-"})
            continue
        if found_failures:
            row.update(status="fails", parity=found_failures[0], source=source)
        if found is None or row["status"] == "fails":
            continue
        worst = {k: max(v, row.get("numbers", {}).get(k, 0.0)) for k, v in found.items()}
        dtype = str(arch_test.references(tuple(cases))[(model_type, packed)]["dtype"]).replace("torch.", "")
        row.update(status="works", numbers=worst, dtype=dtype, source=source,
                   parity=table.format_numbers(worst, dtype, source))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--survey", action="store_true", help="also run every other accepted type on 2 ranks")
    parser.add_argument("--types", default=None, help="only these model types (comma separated); needs --out")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the results and the two pages into this folder instead of in place")
    args = parser.parse_args(argv)
    if args.types and args.out is None:
        parser.error("--types writes partial tables: give --out so that they do not replace the docs")
    import torch
    import transformers

    types = args.types.split(",") if args.types else _all_model_types()
    previous = table.load_results().get("rows", {})
    rows = {t: _verdict(t) for t in types}
    for model_type, row in rows.items():  # keep earlier survey numbers of types not re-measured
        old = previous.get(model_type, {})
        if row["status"] == "not run" and old.get("source") == "survey, 2 ranks" and old["status"] == "works":
            row.update({k: old[k] for k in ("status", "numbers", "dtype", "source", "parity")})
    failures = []
    tested = tuple(case for case in arch_test._cases() if case[0] in rows)
    for world in (2, 3):
        numbers, found = arch_test.measured(world, tested)
        failures += [f for lines in found.values() for f in lines]
        _merge(rows, numbers, found, "test, 2 and 3 ranks", tested)
    if args.survey:
        cases = tuple((t, False) for t, r in rows.items() if r["status"] == "not run" and r.get("tiny"))
        numbers, found = arch_test.measured(2, cases)
        failures += [f for (t, _), lines in found.items() for f in lines
                     if "reference raised" not in f and f"raised ValueError: {t}: " not in f]
        _merge(rows, numbers, found, "survey, 2 ranks", cases)
    for row in rows.values():
        row.pop("tiny", None)
    if failures:
        print("\n".join(failures), file=sys.stderr)
    results = args.out / table.RESULTS.name if args.out else table.RESULTS
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "device": "CPU (gloo)", "torch": torch.__version__,
        "transformers": transformers.__version__, "rows": rows}, indent=1, sort_keys=True) + "\n")
    listed = [{"model type": t, **r} for t, r in sorted(rows.items())]
    for page, rendered in ((table.MODELS_PAGE, table.render(listed, transformers.__version__)),
                           (table.README, table.render_summary(listed, transformers.__version__))):
        target = args.out / page.name if args.out else page
        target.write_text(table.replace_table(page.read_text(), rendered))
    print(f"{sum(r['status'] == 'works' for r in rows.values())} work, "
          f"{sum(r['status'] == 'refused' for r in rows.values())} refused, "
          f"{sum(r['status'] == 'not run' for r in rows.values())} not run; {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
