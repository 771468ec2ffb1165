"""Plots of results files, drawn without a display (matplotlib's Agg backend)."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_lines(ax, points: dict[str, list[tuple[float, float]]], fmt: str = "-", **style) -> None:
    """One line with round markers per label of ``points`` (label -> (x, y) pairs, drawn in x order);
    labels without points are left out."""
    for label, pts in points.items():
        if pts:
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, fmt, marker="o", label=label, **style)


def save(fig, path: Path) -> None:
    """Tighten the layout and write ``fig`` to ``path`` (110 dpi)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
