"""The CPU benches: the shipped pair (or a generated one) on the CPU, in process or as services.

    python -m bench.cpu adaptive [--requests-per-phase 12]    policies vs pinned tiers, phased
    python -m bench.cpu tiers [--workloads load,mixed]        tier 0 and per-request tiers, load
    python -m bench.cpu trees [--shapes 3 7 4x4x16]           chains against trees by batch
    python -m bench.cpu acceptance [--code-prompts 16]        accept length by tier, draft, T
    python -m bench.cpu accept-rules [--prompts 8]            what each exact rule accepts
    python -m bench.cpu tree-rrs [--templates 1x7 2x7]        sampled trees, recursive rejection
    python -m bench.cpu q-temperature [--factors 0.9 1 1.1]   a sampled draft's q at T × F
    python -m bench.cpu engine [--batch 4]                    the in-process engine's tokens/s

`python -m bench.cpu MODE -h` gives a mode's options. `adaptive`, `tiers` and `trees` run the
real services (bench/services.py); the others the in-process engine or the models alone.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from bench.cpu import (
    accept_lengths,
    accept_rules,
    adaptive,
    engine_speedup,
    q_temperature,
    tiers,
    tree_rrs,
    tree_shapes,
)

MODES: dict[str, Callable[[list[str] | None], None]] = {
    "adaptive": adaptive.main,
    "tiers": tiers.main,
    "trees": tree_shapes.main,
    "acceptance": accept_lengths.main,
    "accept-rules": accept_rules.main,
    "tree-rrs": tree_rrs.main,
    "q-temperature": q_temperature.main,
    "engine": engine_speedup.main,
}


def main(argv: list[str] | None = None) -> None:
    """`MODE [options]`; no mode is the default, as none of them is the headline."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in ([], ["-h"], ["--help"]):
        print(__doc__)
        raise SystemExit(0 if args else 2)
    mode = args.pop(0)
    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    MODES[mode](args)


if __name__ == "__main__":
    main()
