"""`bench --plot`: tokens/s and step time against batch size, as a picture; the file checked before
the benchmark runs, so a bad name fails in a second, not after the sweep."""

from __future__ import annotations

import os
from pathlib import Path

from pagedcli.core.errors import UsageError


def plot_path(path: Path) -> Path:
    """Where --plot will write, checked before the benchmark runs: a file in a format matplotlib
    writes (PNG, ".png", when the name has no suffix) in a folder that exists and may be written."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise UsageError(f"--plot {path}: is a folder", "give a file name, e.g. bench.png")
    if not path.suffix:
        path = path.with_suffix(".png")
    if not path.parent.is_dir():
        raise UsageError(f"--plot {path}: no folder {path.parent}", "create it, or save the plot elsewhere")
    if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"--plot {path}: cannot be written (permission denied)", "save the plot elsewhere")
    _pyplot()  # matplotlib is there, before the benchmark runs
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise UsageError(f"--plot {path}: matplotlib cannot write {path.suffix} files",
                         f"use one of {', '.join('.' + f for f in sorted(formats))}")
    return path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib", 'pip install "pagedcli[plot]"') from None
    return plt


def plot(results: list[dict], path: Path) -> None:
    """tokens/s and decode step time against batch size, beside the roofline step time."""
    plt = _pyplot()
    batches = [r["batch"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(batches, [r["decode_tokens_per_s"] for r in results], "o-", label="decode")
    left.plot(batches, [r["output_tokens_per_s"] for r in results], "s--", label="end to end")
    left.set(xlabel="batch", ylabel="tokens/s", title="throughput")
    left.legend()
    right.plot(batches, [r["decode_step_ms"] for r in results], "o-", label="measured")
    right.plot(batches, [r["roofline_step_ms"] for r in results], "k:", label="roofline (bytes / bandwidth)")
    right.set(xlabel="batch", ylabel="ms per decode step", title="step time")
    right.legend()
    for ax in (left, right):  # batch sizes on a log axis, labelled as the numbers they are
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
    fig.suptitle(f"{results[0]['model']} on {results[0]['device']} ({results[0]['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
