"""The README's figure, benchmarks/headline.png, from committed results files.

    python scripts/plot_headline.py [--out benchmarks/headline.png]

Left: Llama-2-7B training step time of torch context parallel over ours (FSDP2, AdamW, bf16) on 2 and
4 H200s. Right: attention forward+backward of one packed row on 2 H200s, ours against the same tokens as
one sequence (ours and torch context parallel) and an all-gather varlen ring on the same kernel.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

#: (label, results file, context) of each training bar; the step times come from the file's rows.
TRAIN = [
    ("64K\n2 x H200", "train-h200-x2-2026-11-22.json", 65536),
    ("128K\n2 x H200", "train-h200-x2-2026-11-22.json", 131072),
    ("128K\n4 x H100", "train-h100-x4-2026-11-26-128k.json", 131072),
]
PACKED = "packed-h100-x2-2026-11-26.json"
#: packed-row implementations shown, in order: (impl, backend or None, label)
PACKED_IMPLS = [
    ("packed_ours", "cudnn_fe", "ours, packed (cudnn_fe)"),
    ("packed_ours", "triton", "ours, packed (Triton)"),
    ("allgather_varlen", "triton", "all-gather varlen ring\n(Triton)"),
    ("unpacked_ours_sdpa_cudnn", None, "ours, as one sequence"),
    ("torch_cp", None, "torch CP, one sequence"),
]


def _step(path: str, seq: int, variant: str) -> float:
    rows = json.loads((RESULTS / path).read_text())["rows"]
    (row,) = [r for r in rows if r["seq"] == seq and r["variant"] == variant and r.get("step_s")]
    return row["step_s"]


def training_ratios() -> list[tuple[str, float]]:
    """(label, torch CP step time / ours) for every training bar."""
    return [(label, _step(path, seq, "torch_cp") / _step(path, seq, "remat")) for label, path, seq in TRAIN]


def packed_times() -> dict[int, list[tuple[str, float]]]:
    """seq -> [(label, ms)] of the packed-row implementations."""
    rows = json.loads((RESULTS / PACKED).read_text())["rows"]
    out: dict[int, list[tuple[str, float]]] = {}
    for seq in sorted({r["seq"] for r in rows}):
        for impl, backend, label in PACKED_IMPLS:
            (row,) = [r for r in rows if r["seq"] == seq and r["impl"] == impl
                      and (backend is None or r.get("backend") == backend)]
            out.setdefault(seq, []).append((label, row["ms"]))
    return out


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1.25]})
    ratios = training_ratios()
    bars = left.bar([label for label, _ in ratios], [r for _, r in ratios], color="tab:blue")
    left.bar_label(bars, labels=[f"{r:.2f}x" for _, r in ratios])
    left.axhline(1.0, color="gray", lw=1, ls="--")
    left.set_ylim(0, max(r for _, r in ratios) * 1.2)
    left.set_ylabel("torch CP step time / ours")
    left.set_title("Llama-2-7B training step\n(FSDP2 + AdamW, bf16; higher is better)", fontsize=10)

    times = packed_times()
    seqs = list(times)
    width = 0.8 / len(PACKED_IMPLS)
    for i, (_, _, label) in enumerate(PACKED_IMPLS):
        xs = [k + (i - (len(PACKED_IMPLS) - 1) / 2) * width for k in range(len(seqs))]
        ms = [times[s][i][1] for s in seqs]
        bars = right.bar(xs, ms, width, label=label.replace("\n", " "))
        right.bar_label(bars, labels=[f"{m:.0f}" for m in ms], fontsize=8)
    right.set_xticks(range(len(seqs)), [f"{s // 1024}K-token row" for s in seqs])
    right.set_ylabel("forward+backward, ms")
    right.set_title("packed documents, 2 x H100, attention only\n(32/8 heads, d 128; lower is better)",
                    fontsize=10)
    right.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "headline.png")
    args = parser.parse_args(argv)
    plot(args.out)
    for label, ratio in training_ratios():
        print(f"training {label.replace(chr(10), ', ')}: {ratio:.2f}x")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
