"""Figures of the mpidl commands: matplotlib without a display, one house style."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any


def require() -> None:
    """Raise a clear error now, before a long run, if matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'mpidl[plot]'")


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (writes files, needs no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish(fig: Any, axes: Sequence[Any], path: str) -> None:
    """Grid and legend on every axis, then save ``fig`` to ``path`` and close it."""
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
