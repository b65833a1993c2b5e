"""Host time around the graphs: where a round's wall time goes besides the GPU's.

For the 8B target + EAGLE head at batch 1 (random weights, prompt 512), per stage (draft round,
verify): wall time vs the GPU time of its graph replays (CUDA events), then the host functions
that take the most time inside each stage (cProfile over the timed rounds; cProfile slows
Python down, so read its column as a ranking, the first table as the truth).

    python -m bench.gpu_host [--tier 3] [--rounds 200] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import device_info, format_table, write_json
from bench.gpu_common import RoundLoop, build_pair, median
from specpair.runtime.state import gpu_ms

TOP = 12


def profile_rows(profile: cProfile.Profile, rounds: int) -> list[dict[str, Any]]:
    """The functions with the most own time, per round."""
    stats = pstats.Stats(profile)
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(file).name}:{line}" if line else file
        rows.append({"function": f"{name} ({where})", "calls": calls / rounds,
                     "own_us": 1e6 * own / rounds, "cum_us": 1e6 * cum / rounds})  # fmt: skip
    return sorted(rows, key=lambda r: -r["own_us"])[:TOP]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_host.json"))
    args = parser.parse_args()
    info = device_info()
    worker, drafter, states, _ = build_pair("eagle", 1, [1], [args.tier], args.prompt + 2048)
    state = states[args.tier]
    prompt = [torch.randint(0, 128256, (args.prompt,)).tolist()]
    loop = RoundLoop(worker, drafter, prompt)
    drafter.profile = False  # no sync between extend and steps: time it as served
    for _ in range(5):
        loop.step(state)
    wall: dict[str, list[float]] = {"draft": [], "verify": []}
    gpu: dict[str, list[float]] = {"draft": [], "verify": []}
    profiles = {"draft": cProfile.Profile(), "verify": cProfile.Profile()}
    for profiled in (False, True):
        for _ in range(args.rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if profiled:
                profiles["draft"].enable()
            flight = loop.start(state)  # the round's request built and drafted, as served
            if profiled:
                profiles["draft"].disable()
                profiles["verify"].enable()
            t1 = time.perf_counter()
            loop.finish(flight)  # verify, accept, commit; the EAGLE features recorded
            t2 = time.perf_counter()
            if profiled:
                profiles["verify"].disable()
            else:
                wall["draft"].append(1e3 * (t1 - t0))
                wall["verify"].append(1e3 * (t2 - t1))
                gpu["draft"].append(gpu_ms(drafter))
                gpu["verify"].append(gpu_ms(worker))
    loop.close()
    stages: dict[str, dict[str, Any]] = {
        k: {"wall_ms": median(wall[k]), "gpu_ms": median(gpu[k]),
            "host_ms": median([w - g for w, g in zip(wall[k], gpu[k], strict=True)]),
            "top": profile_rows(profiles[k], args.rounds)}
        for k in wall
    }  # fmt: skip
    write_json(args.out, {"device": info, "tier": args.tier, "rounds": args.rounds, **stages})
    print(f"\nHost time per stage, tier {args.tier}, batch 1, prompt {args.prompt} — "
          f"{info.get('gpu')} (p50 of {args.rounds} rounds)")  # fmt: skip
    for k, st in stages.items():
        print(f"\n{k}: wall {st['wall_ms']:.3f} ms, graphs on the GPU {st['gpu_ms']:.3f} ms, "
              f"host {st['host_ms']:.3f} ms; most own time (cProfile, per round):")  # fmt: skip
        print(format_table(["function", "calls", "own us", "cum us"], [
            [r["function"][:70], f"{r['calls']:.1f}", f"{r['own_us']:.1f}", f"{r['cum_us']:.1f}"]
            for r in st["top"]
        ]))  # fmt: skip
    print(format_table(
        ["stage", "wall ms", "GPU ms", "host ms"],
        [[k, f"{st['wall_ms']:.3f}", f"{st['gpu_ms']:.3f}", f"{st['host_ms']:.3f}"]
         for k, st in stages.items()],
    ))  # fmt: skip


if __name__ == "__main__":
    main()
