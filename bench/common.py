"""Helpers every benchmark shares: device description, free ports, timing statistics, tables,
JSON output."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specpair.runtime.shape import ShapeError, TreeShape


def add_output_args(parser: argparse.ArgumentParser, default_out: str) -> None:
    """`--out` (full JSON results) and `--repeats` (timed runs after one warm-up)."""
    parser.add_argument("--out", type=Path, default=Path(default_out), help="JSON results file")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the median is kept")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_list(text: str) -> set[int]:
    """'0-3,8' -> {0, 1, 2, 3, 8}."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def shape_arg(text: str) -> TreeShape:
    """An argparse type: "7" → the chain of 7, "4x4x16" → a tree; a bad shape is a usage error
    that says why (argparse would print only "invalid value" for the ShapeError)."""
    try:
        return TreeShape.parse(text)
    except ShapeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def free_port() -> int:
    """A loopback port free now; the kernel may lend it again before the caller binds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_address() -> str:
    return f"127.0.0.1:{free_port()}"


def device_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def cpu_run(threads: int) -> dict[str, Any]:
    """A CPU benchmark's start: torch on `threads` threads, the device line printed; returns
    `device_info()`."""
    torch.set_num_threads(threads)
    info = device_info()
    print(f"device: {info['cpu']}, {info['torch_threads']} threads, torch {info['torch']}")
    return info


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile, q in [0, 100] (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def median(values: Sequence[float]) -> float:
    """The 50th percentile: the middle value, or the mean of the two middle ones."""
    return percentile(values, 50)


@dataclass(frozen=True, slots=True)
class Stats:
    """Summary of repeated measurements of one quantity."""

    median: float
    p10: float
    p90: float
    min: float
    max: float
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        return cls(
            median=median(samples),
            p10=percentile(samples, 10),
            p90=percentile(samples, 90),
            min=min(samples),
            max=max(samples),
            samples=tuple(samples),
        )


def format_optional(value: float | None, spec: str) -> str:
    """`value` formatted by `spec`, or "-" for a table cell with nothing measured."""
    return "-" if value is None else format(value, spec)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain aligned text: first column left-aligned, the rest right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def grouped_bars(
    series: dict[str, dict[str, float]],
    path: Path,
    title: str,
    ylabel: str,
    baseline: float | None = None,
) -> None:
    """A PNG of bars: per group (the inner keys, in first-seen order) one bar per series (the
    outer keys), e.g. {"1 GPU": {"greedy\n1 client": 380.7, …}, "2 GPUs": {…}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(g for values in series.values() for g in values))
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups)), 4.0))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + k * width for i, g in enumerate(groups) if g in values]
        ax.bar(xs, [values[g] for g in groups if g in values], width, label=name)
    if baseline is not None:
        ax.axhline(baseline, color="grey", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(path: Path, payload: Any) -> None:
    """Writes `payload` (dataclasses allowed) as indented JSON, creating parent folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_to_json) + "\n")


def read_json(path: Path) -> Any:
    """A written report; `.json.gz` is read through gzip (older runs are kept compressed, as
    the working tree sent to the GPU machine is capped at 64 MiB)."""
    if path.suffix == ".gz":
        import gzip

        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())


def _to_json(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot write {type(obj).__name__} as JSON")
