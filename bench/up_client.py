"""The speed a user meets: `specpair up` started as a user starts it, driven by the `openai`
client over the HTTP API and by the SDK over gRPC.

`bench/gpu_speedup.py` starts each service itself with the options a benchmark wants; this one
runs the `specpair up` command (its defaults: max batch, tiers 0/1/3/7, the controller's
SGLang rule) on free ports and changes nothing behind it but what the ops API offers a user:
`ctl pin N` and a policy update. Configurations, each on the one running deployment:

- `sglang`: the policy `up` starts with (SGLang's rule over tiers 1/3/7, counting a full
  chain's expected tail, its moves checked against the round times), first, untouched
  (`policy` instead with `--policy FILE`: `up --policy FILE`'s); on a later turn set again
  from tier 3;
- `verbatim`: SGLang's rule as SGLang counts (`expect_tail=false`), set live,
  afresh from tier 3 (`up`'s first tier);
- `sglang KEY=VALUE …` (`--variant KEY=VALUE …`): the sglang kind with those keys changed, set
  live, afresh from tier 3;
- `goodput`: the goodput kind over tiers 0/1/3/7, set live (`ctl policy kind=goodput …`),
  afresh from tier 3;
- `tier 0`: pinned to tier 0, the target alone (`up` builds its runtime state at start-up so
  that a user can compare); every x is over it, same door, workload and batch;
- `tier N`: pinned (`--tiers`).

Doors: `openai` = `openai.OpenAI(base_url=.../v1).completions.create(prompt=<token ids>)`, the
completion's `usage.completion_tokens` counted; `http` = the same body POSTed with `urllib` (the
API without the client package's own cost); `sdk` = `SpecpairClient.generate`. A cell runs
its requests `batch` at a time (threads) after one warm-up request; tokens/s = completion
tokens / wall seconds, pooled over `--repeats` turns, each over every configuration and door,
in order and then backwards (`turn_order`: A B B A, so that drift moves all alike). `steady x`
is the same ratio over the window in which every client had a request in flight (`steady`):
a cell ends with its clients running out one by one, and speculation's requests, each prompt
accepting at its own rate, run out more unevenly than the target alone's. `GPU bound x` (the
rounds table, on a GPU) is the ratio the cell's acceptance would give were speculation to add
only its GPU work to the target alone's round (`gpu_bound`), `quiet x` the ratio of its rounds
without a join alone, each at the batch its cell held (`quiet_x`). `ttft ms` is the target's mean
time to first token over the cell (its exporter, scraped before and after: a request's queue and
prefill), `wire ms` a client's mean call beyond the target's mean latency (the request's way in,
its last token's way out, the SDK), `undrafted` the request-rounds decoded without drafts
against their tier (a draft that refused a request for want of a slot, failed, or was late: 0
in a healthy cell), `switches` the tier switches the target applied over the cell, `gc ms`
the target's / the draft's garbage-collector pauses over the cell (their exporters), `rides` the
joins whose prompt rode in a verify / all joins (`--lab ride_rows=N`), `eager` the verifies
whose sampled accept ran eagerly, not in an accept graph / all verifies; the JSON
keeps each cell's slowest rounds whole (`slowest`), where a spike shows its stage; `quiet` is
its mean round without a join and `a join` the time rounds took over that per joining request
(`join_costs`). Held-out code
prompts (`bench.prompts`), greedy and T = 0.7 top-p 0.95 with a seed per request.

    python -m bench.up_client --draft-kind eagle3 --batches 1 8 --requests 8 32 \\
        --new-tokens 128 [--token-map MAP] [--out bench/out/up_client.json]
    python -m bench.up_client --device cpu --shape shipped --batches 1 --requests 2 \\
        --new-tokens 8 --tiers 3   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, astuple, dataclass, field, replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.common import device_info, format_table, free_address, grouped_bars, write_json
from bench.gpu_speedup import (
    GOODPUT,
    Workload,
    add_pair_args,
    bench_pair,
    make_workloads,
    request_counts,
)
from bench.services import add_lab_arg, lab_env, lab_fields, rounds_watched, wait_draft_connected
from specpair.cli.client_commands import policy_changes
from specpair.cli.launcher import READY
from specpair.cli.options import TOKEN_ENV
from specpair.client import ControllerClient, SpecpairClient, SpecpairError
from specpair.config import FeatureDType
from specpair.runtime.round_messages import RoundStats

STAGES = (
    "total",
    "draft",
    "draft_gpu",
    "rpc",
    "wait",
    "verify",
    "verify_gpu",
    "schedule",
    "admit",
    "handoff",
)

DOORS = ("openai", "http", "sdk")
SLOWEST = 5  # rounds kept whole per cell (`slowest`): where a cell's spikes lie
Door = Callable[[list[int], int, Any], int]  # (prompt ids, max tokens, sampling) -> tokens


SERVED = {  # the target's exporter's samples `Served` sums (over their labels)
    "ttft_s": "specpair_target_time_to_first_token_seconds_sum",
    "ttft_count": "specpair_target_time_to_first_token_seconds_count",
    "latency_s": "specpair_target_request_latency_seconds_sum",
    "latency_count": "specpair_target_request_latency_seconds_count",
    "undrafted": "specpair_target_plain_rounds_total",
    "switches": "specpair_target_tier_switches_total",
    "gc_s": "specpair_target_gc_pause_seconds_total",
    "draft_gc_s": "specpair_draft_gc_pause_seconds_total",  # from the draft's exporter
    "joins": "specpair_target_joins_total",
    "rides": "specpair_target_joins_total:ride",  # those whose prompt rode in a verify
    "accepts": "specpair_target_accepts_total",  # verifies, by where their accept ran:
    "eager_accepts": "specpair_target_accepts_total:device",  # a sampled batch eagerly
}


@dataclass
class Served:
    """What the target's exporter counts of the requests it served: sums and counts of their
    time to first token and latency (s), and the rounds a request was decoded without drafts
    against its tier (a draft that refused it for want of a slot, failed or was late; every
    reason), as read, or their growth over a cell."""

    ttft_s: float = 0.0
    ttft_count: float = 0.0
    latency_s: float = 0.0
    latency_count: float = 0.0
    undrafted: float = 0.0
    switches: float = 0.0  # tier switches the target applied
    gc_s: float = 0.0  # the target's garbage-collector pauses (every generation)
    draft_gc_s: float = 0.0  # the draft's
    joins: float = 0.0  # requests admitted into the batch
    rides: float = 0.0  # of them, those whose prompt rode in a verify (`ride_rows`)
    accepts: float = 0.0  # verifies
    eager_accepts: float = 0.0  # of them, sampled batches accepted eagerly, not in a graph

    @classmethod
    def read(cls, *addresses: str) -> Served:
        """Scrapes the exporters at `addresses` (the target's, the draft's; "": none there)."""
        values: dict[str, float] = {}
        for address in filter(None, addresses):
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
                text = reply.read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
                    for label in sample.labels.values():  # one label's share: NAME:VALUE
                        key = f"{sample.name}:{label}"
                        values[key] = values.get(key, 0.0) + sample.value
        return cls(**{key: values.get(name, 0.0) for key, name in SERVED.items()})

    def __sub__(self, other: Served) -> Served:
        return Served(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __add__(self, other: Served) -> Served:
        return Served(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass
class UpCell:
    config: str  # "tier 0" | "tier 7" | "sglang" | "sglang KEY=VALUE" | "verbatim" | "goodput"
    door: str  # "openai" | "sdk"
    workload: str
    batch: int
    tokens: int  # over all its runs
    seconds: float
    runs: list[float] = field(default_factory=list)  # tokens/s of each run
    speedup: float | None = None  # over "tier 0", same door, workload and batch
    # while every client had a request in flight (`steady`), over all its runs
    steady_tokens: float = 0.0
    steady_seconds: float = 0.0
    steady_speedup: float | None = None  # over "tier 0"'s, as `speedup`
    # over all its runs: the target's sums of its requests' time to first token (arrival to
    # the first token streamed: queue and prefill) and latency (arrival to the last), and the
    # clients' (call to return; beyond the target's latency: the wire and the SDK both ways)
    served: Served = field(default_factory=Served)
    client_s: float = 0.0
    requests: int = 0
    gpu_bound: float | None = None  # `gpu_bound`: x were speculation to add only GPU work
    quiet_x: float | None = None  # `quiet_x`: x of its rounds without a join alone
    # the target's rounds during the cell's runs (WatchRounds): means of a round's stage ms,
    # its batch size and accepted draft tokens a drafted request (`anatomy`)
    rounds: dict[str, float] = field(default_factory=dict)
    # the last run's SLOWEST rounds, each whole (`slowest`)
    slowest: list[dict[str, float]] = field(default_factory=list)

    @property
    def spread(self) -> float | None:
        """(fastest − slowest run) / the pooled tokens/s; None with one run."""
        if len(self.runs) < 2:
            return None
        return (max(self.runs) - min(self.runs)) / self.tokens_per_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def steady_tokens_per_s(self) -> float | None:
        return self.steady_tokens / self.steady_seconds if self.steady_seconds > 0 else None

    @property
    def ttft_ms(self) -> float | None:
        """The target's mean time to first token: a request's queue and prefill."""
        s = self.served
        return 1e3 * s.ttft_s / s.ttft_count if s.ttft_count else None

    @property
    def wire_ms(self) -> float | None:
        """A client's mean call beyond the target's mean latency: the request's way in and its
        last token's way out, the SDK included (with the target's ttft, the time a client
        waits outside the batch)."""
        s = self.served
        if not s.latency_count or not self.requests:
            return None
        return 1e3 * (self.client_s / self.requests - s.latency_s / s.latency_count)


Span = tuple[float, float, int]  # a request's start and end (perf_counter s), its tokens


def steady(spans: Sequence[Span], t0: float) -> tuple[float, float]:
    """(tokens, seconds) of a cell's run from `t0` to its last request's start: the window in
    which every client had a request in flight. After it the clients run out one by one, for
    as long as their last requests are unequal: the target alone's all take 128 rounds, but with
    speculation each prompt accepts at its own rate (at 64 clients, 2 requests a client, tier
    7's rounds held 40 requests on average against the target alone's 58). A request's tokens
    count in proportion to its time inside the window (decoding runs at a steady pace).
    Clients A: 0-10 s, 10-20 s and B: 0-15 s, 15-30 s, 100 tokens each: the window is 0-15 s,
    with 100 + 50 + 100 + 0 tokens, 16.7 tok/s against the whole run's 400 / 30 = 13.3."""
    end = max(start for start, _, _ in spans)
    tokens = sum(k * max(0.0, min(e, end) - max(s, t0)) / (e - s) for s, e, k in spans if e > s)
    return tokens, end - t0


@dataclass(frozen=True)
class Up:
    """A running `specpair up`: its addresses, log and ops token."""

    target: str
    controller: str
    http: str
    log: Path
    token: str
    metrics: str = ""  # the target's Prometheus exporter ("": none to read)
    draft_metrics: str = ""  # the draft's


def up_command(args: argparse.Namespace, target: Path, draft: Path) -> list[str]:
    """`specpair up` as a user types it (run as `python -m specpair.cli`: no console script
    needed on the device)."""
    command = [
        sys.executable, "-m", "specpair.cli", "up", "--device", args.device,
        "--draft-kind", "eagle" if args.draft_kind.startswith("eagle") else "model",
        "--target-model", str(target), "--draft-model", str(draft),
    ]  # fmt: skip
    if args.token_map:
        command += ["--draft-token-map", str(args.token_map)]
    if args.max_batch:
        command += ["--max-batch", str(args.max_batch)]
    if args.policy:
        command += ["--policy", str(args.policy)]
    if args.feature_dtype != FeatureDType.AUTO:
        command += ["--feature-dtype", args.feature_dtype]
    if args.feature_ring_mib is not None:
        command += ["--feature-ring-mib", str(args.feature_ring_mib)]
    if args.draft_window is not None:
        command += ["--draft-window", str(args.draft_window)]
    return command


@contextmanager
def running_up(
    command: list[str],
    log: Path,
    timeout_s: float = 900.0,
    env_changes: Mapping[str, str | None] | None = None,
) -> Iterator[Up]:
    """Starts `command` on free loopback ports, echoes its `specpair up:` lines, waits for its
    READY line, and stops it on the way out with SIGTERM, which `up` takes as Ctrl-C (SIGINT
    does nothing to a process a non-interactive shell's background job started: it inherits
    SIGINT ignored, and `up` would be killed after the wait, its services left running).
    `env_changes`: variables set for it (None: unset)."""
    # the group's ops token, given (`up` makes one of its own where none is set)
    token = os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(16)
    up = Up(free_address(), free_address(), free_address(), log, token)
    env = os.environ | {
        "SPECPAIR_TARGET_ADDRESS": up.target,
        "SPECPAIR_CONTROLLER_ADDRESS": up.controller,
        "SPECPAIR_DRAFT_ADDRESS": free_address(),
        "SPECPAIR_HTTP_ADDRESS": up.http,
        TOKEN_ENV: token,
        "PYTHONUNBUFFERED": "1",
    }
    for service in ("TARGET", "DRAFT", "CONTROLLER"):  # several `up`s may run side by side
        env[f"SPECPAIR_{service}_METRICS"] = free_address()
    for name, value in (env_changes or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    up = replace(
        up,
        metrics=env.get("SPECPAIR_TARGET_METRICS", ""),
        draft_metrics=env.get("SPECPAIR_DRAFT_METRICS", ""),
    )
    log.parent.mkdir(parents=True, exist_ok=True)
    print("$ " + " ".join(command), flush=True)
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    ready = threading.Event()

    def pump() -> None:  # the whole output to the log, `up`'s own lines to the console
        assert proc.stdout is not None
        with log.open("w") as sink:
            for line in proc.stdout:
                sink.write(line)
                sink.flush()
                if line.startswith("specpair up:"):
                    print("  " + line.rstrip(), flush=True)
                if READY in line:
                    ready.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not ready.wait(1.0):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"specpair up did not come up (see {log})")
        yield up
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(10)


def openai_door(up: Up) -> Door:
    import openai

    client = openai.OpenAI(
        base_url=f"http://{up.http}/v1",
        api_key=os.environ.get("SPECPAIR_API_KEY", "unused"),
        max_retries=0,
        timeout=600,
    )

    def one(ids: list[int], max_tokens: int, p: Any) -> int:
        reply = client.completions.create(
            model="specpair", prompt=ids, max_tokens=max_tokens, temperature=p.temperature,
            top_p=p.top_p, seed=p.seed,
        )  # fmt: skip
        assert reply.usage is not None
        return reply.usage.completion_tokens

    return one


def http_door(up: Up) -> Door:
    """The same body as the openai door's, POSTed with the standard library: what the HTTP API
    costs without the `openai` package's own per-request work."""
    url = f"http://{up.http}/v1/completions"
    headers = {"Content-Type": "application/json"}
    if key := os.environ.get("SPECPAIR_API_KEY"):
        headers["Authorization"] = f"Bearer {key}"

    def one(ids: list[int], max_tokens: int, p: Any) -> int:
        body = {"model": "specpair", "prompt": ids, "max_tokens": max_tokens,
                "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed}  # fmt: skip
        request = urllib.request.Request(url, json.dumps(body).encode(), headers)
        with urllib.request.urlopen(request, timeout=600) as reply:
            return int(json.load(reply)["usage"]["completion_tokens"])

    return one


def sdk_door(up: Up) -> Door:
    client = SpecpairClient(up.target, timeout=600)

    def one(ids: list[int], max_tokens: int, p: Any) -> int:
        result = client.generate(
            ids, max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p, seed=p.seed
        )
        return len(result.token_ids)

    return one


def anatomy(rounds: Sequence[RoundStats]) -> dict[str, float]:
    """A cell's rounds in a few means: how many, their batch, accepted tokens a drafted request,
    the rows a verify computed (riders' chunks and a graph's padding included), and each
    stage's ms a round (`StageTimings`: `admit` = joining, inside `total`; `handoff` = the
    joiners' prompts to the draft, inside `admit`)."""
    if not rounds:
        return {}
    n = len(rounds)
    accepts = [a for r in rounds for a in r.accept_lengths]
    out = {
        "rounds": float(n),
        "batch": sum(r.batch_size for r in rounds) / n,
        "accept": sum(accepts) / len(accepts) if accepts else 0.0,
        "verify_rows": sum(r.verify_rows for r in rounds) / n,
    }
    for stage in STAGES:
        out[stage] = sum(getattr(r.timings, f"{stage}_ms") for r in rounds) / n
    out["at_7"] = share_at(rounds, 7)
    out |= join_costs(rounds)
    # joining comes in spikes (a wave of joiners, then none): its median and largest round
    for stage in ("admit", "handoff"):
        ms = sorted(getattr(r.timings, f"{stage}_ms") for r in rounds)
        out[f"{stage}_p50"], out[f"{stage}_max"] = ms[n // 2], ms[-1]
    return out


def join_costs(rounds: Sequence[RoundStats]) -> dict[str, float]:
    """What joining costs a cell's rounds: the mean round without an admission (`quiet`), with
    one (`joining`), and the time rounds took over quiet ones per joining request (`a_join`,
    ms; a request joins where its id first shows). Rounds of 10 ms quiet and one of 30 ms that
    admitted 2 requests: a join costs (30 - 10) / 2 = 10 ms."""
    quiet = [r.timings.total_ms for r in rounds if r.timings.admit_ms == 0]
    joining = [r.timings.total_ms for r in rounds if r.timings.admit_ms > 0]
    ids = {i for r in rounds for i in (*r.request_ids, *r.plain_request_ids)}
    if not quiet or not joining or not ids:
        return {}
    base = sum(quiet) / len(quiet)
    return {
        "quiet_total": base,
        "joining_total": sum(joining) / len(joining),
        "joining_share": len(joining) / len(rounds),
        "a_join": sum(t - base for t in joining) / len(ids),
    }


def slowest(rounds: Sequence[RoundStats], start: float, n: int = SLOWEST) -> list[dict[str, float]]:
    """The `n` longest rounds, slowest first, each with its stages' ms, its tier and batch,
    and when it was published (s after `start`, the cell's start as time.time()): a cell's
    first waves at a new batch size show here as one or two rounds of 100+ ms in `admit` or
    `handoff` (an H200, 64 clients, a fresh `up`: 192 and 74 ms)."""
    out = []
    for r in sorted(rounds, key=lambda r: r.timings.total_ms, reverse=True)[:n]:
        row = {stage: getattr(r.timings, f"{stage}_ms") for stage in STAGES}
        row |= {"round_id": float(r.round_id), "steps": float(r.speculative_num_steps)}
        row |= {"batch": float(r.batch_size), "at_s": r.unix_time - start}
        out.append(row)
    return out


def share_at(rounds: Sequence[RoundStats], steps: int) -> float:
    """The share of drafted request-rounds that ran `steps` drafts: what a policy chose, where
    tokens/s alone cannot tell a tier's choice from the machine's noise. Rounds at [7, 7, 3]
    with batches of 2, 2, 4: 4 of 8, 0.5."""
    tiers = [
        s
        for r in rounds
        for s in (r.request_steps or (r.speculative_num_steps,) * len(r.accept_lengths))
    ]
    return sum(s == steps for s in tiers) / len(tiers) if tiers else 0.0


Cells = dict[tuple[str, str, str, int], UpCell]  # (config, door, workload, batch) → its cell


def run_cells(
    up: Up, config: str, workloads: Sequence[Workload], counts: dict[int, int],
    new_tokens: int, doors: Sequence[str], cells: Cells, record: Callable[[UpCell], None],
) -> None:  # fmt: skip
    """One run of every door, workload and batch under the configuration now applied, the
    doors in `doors`' order, pooled into `cells`; `record` gets each cell after its run,
    pooled so far."""
    makers = {"openai": openai_door, "http": http_door, "sdk": sdk_door}
    ones = {door: makers[door](up) for door in doors}
    for door, one in ones.items():
        one(workloads[0].ids[0], 8, workloads[0].sampling(0))  # warm: connection, a round
        for wl in workloads:
            for batch, n in counts.items():
                spans: list[Span] = []

                def request(
                    i: int, wl: Workload = wl, one: Door = one, spans: list[Span] = spans
                ) -> int:
                    start = time.perf_counter()
                    tokens = one(wl.ids[i], new_tokens, wl.sampling(i))
                    spans.append((start, time.perf_counter(), tokens))
                    return tokens

                rounds: list[RoundStats] = []
                served = Served.read(up.metrics, up.draft_metrics)
                with rounds_watched(up.target, rounds, up.token):
                    t0, wall0 = time.perf_counter(), time.time()
                    with ThreadPoolExecutor(batch) as pool:
                        tokens = sum(pool.map(request, range(n)))
                    seconds = time.perf_counter() - t0
                served = Served.read(up.metrics, up.draft_metrics) - served
                cell = cells.setdefault(
                    (config, door, wl.name, batch),
                    UpCell(config, door, wl.name, batch, 0, 0.0),
                )
                cell.tokens += tokens
                cell.seconds += seconds
                cell.served += served
                cell.client_s += sum(end - start for start, end, _ in spans)
                cell.requests += len(spans)
                if n > batch:  # else every request started at once: no steady window
                    window_tokens, window_s = steady(spans, t0)
                    cell.steady_tokens += window_tokens
                    cell.steady_seconds += window_s
                cell.runs.append(tokens / seconds)
                cell.rounds = anatomy(rounds)  # the last run's
                cell.slowest = slowest(rounds, wall0)
                record(cell)  # after every run: a run cut short keeps the cells before it


def turn_order(configs: Sequence[str], turn: int) -> list[str]:
    """Turn 0 runs the configurations in order, turn 1 backwards, and so on (A B B A …): a
    machine that drifts through a call moves every configuration's pooled runs alike, and the
    first configuration is not the only one to meet a cold `up`. [a, b, c], turn 1: [c, b, a]."""
    return list(configs) if turn % 2 == 0 else list(reversed(configs))


def apply(ctl: ControllerClient, config: str, afresh: bool) -> None:
    """Applies a configuration. `afresh`: the one `up` started with (`sglang`), as at
    start-up: set again from tier 3, after a turn of others; false only on the first turn,
    where it is untouched."""
    if config == "sglang" and afresh:
        sglang_from_tier_3(ctl)
    elif config.startswith("sglang "):  # a variant: "sglang expect_tail=false ema_alpha=0.5"
        sglang_from_tier_3(ctl, **policy_changes(config.split()[1:]))
    elif config.startswith("tier "):
        tier = int(config.removeprefix("tier "))
        try:
            ctl.pin(tier)
        except SpecpairError as exc:  # SGLang's rule has no tier 0 (goodput skipped): set it
            if exc.code != "INVALID_ARGUMENT" or "not a candidate" not in exc.details:
                raise
            ctl.update_policy(**GOODPUT)
            ctl.pin(tier)
    elif config == "goodput":
        ctl.pin(3)  # afresh from tier 3, as in gpu_speedup
        ctl.update_policy(**GOODPUT)
        ctl.unpin()
    elif config == "verbatim":
        sglang_from_tier_3(ctl, expect_tail=False)
    time.sleep(0.3)


def sglang_from_tier_3(ctl: ControllerClient, **changes: Any) -> None:
    """The sglang kind over tiers 1/3/7 afresh (its EMA, its count) from tier 3, `up`'s first,
    its keys at their defaults but `changes` (as `policy_changes` types `ctl policy`'s)."""
    ctl.pin(3)
    ctl.update_policy(**GOODPUT)  # another kind between: the sglang kind starts afresh
    ctl.update_policy(kind="sglang", candidate_steps="1,3,7", **changes)
    ctl.unpin()


def pin_target_alone(ctl: ControllerClient) -> None:
    """Tier 0 pinned (the target alone: `up` builds its state); SGLang's rule, `up`'s policy,
    has no tier 0 to pin, so the goodput kind is set first."""
    ctl.update_policy(**GOODPUT)
    ctl.pin(0)
    time.sleep(0.3)


def fill_ratios(cells: list[UpCell]) -> None:
    alone = {(c.door, c.workload, c.batch): c for c in cells if c.config == "tier 0"}
    for c in cells:
        if (base := alone.get((c.door, c.workload, c.batch))) is not None:
            c.speedup = c.tokens_per_s / base.tokens_per_s
            ours, theirs = c.steady_tokens_per_s, base.steady_tokens_per_s
            c.steady_speedup = ours / theirs if ours and theirs else None
            c.gpu_bound = gpu_bound(c.rounds, base.rounds)
            c.quiet_x = quiet_x(c.rounds, base.rounds)


def gpu_bound(ours: Mapping[str, float], alone: Mapping[str, float]) -> float | None:
    """The x a cell's acceptance would give were speculation to add only its GPU work to the
    target alone's round: the verify's GPU time in place of the target alone's, and the draft's
    graphs; every host cost of two services (the wire, the hand-off, the draft's host loop,
    admission beside the draft) at zero. An upper bound on what host work can win back.

    Worked example (8 clients at T 0.7 on an H200, the draft's whole 4.73 ms standing in for
    its graphs'): the target alone's round 7.04 ms with 4.87 of verify GPU; a tier-7 round's
    verify 5.79 ms of GPU, 2.34 accepted: 3.34 tokens a request in 7.04 − 4.87 + 5.79 + 4.73 =
    12.69 ms against 1 in 7.04, 1.85×.
    None where either cell has no rounds, the target alone's round took no time, or no
    draft's GPU time was recorded (a CPU run)."""
    if not ours or not alone or ours.get("accept", 0.0) <= 0.0:
        return None
    base, draft_gpu = alone.get("total", 0.0), ours.get("draft_gpu", 0.0)
    if base <= 0.0 or draft_gpu <= 0.0:
        return None
    round_ms = base - alone["verify_gpu"] + ours["verify_gpu"] + draft_gpu
    return (1.0 + ours["accept"]) * base / round_ms


def quiet_x(ours: Mapping[str, float], alone: Mapping[str, float]) -> float | None:
    """The x a cell's rounds without a join (`quiet`) give over the target alone's, each at
    the batch its cell held: what joins cost, as the x they take away (a drafted batch also
    holds fewer requests, its requests living fewer rounds: that stays in).

    Worked example (8 clients greedy on an H200): tier 7's quiet rounds 11.59 ms, 7.23
    requests, 4.42 accepted; the target alone's 6.72 ms, 7.84 requests: 5.42 tokens a request
    × 6.72 / 11.59 × 7.23 / 7.84 = 2.90×, where the cell ran 2.51×.
    None where either cell has no quiet rounds or nothing was drafted."""
    if ours.get("accept", 0.0) <= 0.0:
        return None
    quiet, base = ours.get("quiet_total", 0.0), alone.get("quiet_total", 0.0)
    if quiet <= 0.0 or base <= 0.0 or alone.get("batch", 0.0) <= 0.0:
        return None
    return (1.0 + ours["accept"]) * base / quiet * ours["batch"] / alone["batch"]


def render(cells: Sequence[UpCell]) -> str:
    rows = [
        [c.config, c.door, c.workload, str(c.batch), f"{c.tokens_per_s:.1f}",
         "-" if c.speedup is None else f"{c.speedup:.2f}",
         "-" if c.steady_speedup is None else f"{c.steady_speedup:.2f}",
         "-" if c.spread is None else f"{100 * c.spread:.0f} %",
         "-" if c.ttft_ms is None else f"{c.ttft_ms:.1f}",
         "-" if c.wire_ms is None else f"{c.wire_ms:.1f}",
         f"{c.served.undrafted:.0f}", f"{c.served.switches:.0f}",
         f"{1e3 * c.served.gc_s:.0f} / {1e3 * c.served.draft_gc_s:.0f}",
         f"{c.served.rides:.0f} / {c.served.joins:.0f}",
         f"{c.served.eager_accepts:.0f} / {c.served.accepts:.0f}"]
        for c in cells
    ]  # fmt: skip
    headers = ["config", "door", "workload", "batch", "tok/s", "x tier 0", "steady x", "spread"]
    headers += ["ttft ms", "wire ms", "undrafted", "switches", "gc ms", "rides", "eager"]
    return format_table(headers, rows)


def render_anatomy(cells: Sequence[UpCell]) -> str:
    """Each cell's rounds (its last run): the batch they ran, accepted draft tokens a drafted
    request, and ms a round by stage."""
    rows = [
        [
            c.config,
            c.workload,
            str(c.batch),
            f"{c.rounds['rounds']:.0f}",
            f"{c.rounds['batch']:.1f}",
            f"{c.rounds['accept']:.2f}",
            f"{c.rounds.get('at_7', 0.0):.2f}",
            f"{c.rounds.get('verify_rows', 0.0):.0f}",
            *(f"{c.rounds[stage]:.2f}" for stage in STAGES),
            *(f"{c.rounds[k]:.2f}" if k in c.rounds else "-" for k in ("quiet_total", "a_join")),
            "-" if c.gpu_bound is None else f"{c.gpu_bound:.2f}",
            "-" if c.quiet_x is None else f"{c.quiet_x:.2f}",
        ]
        for c in cells
        if c.rounds
    ]
    headers = ["config", "workload", "clients", "rounds", "batch", "accept", "at 7", "rows"]
    headers += [*STAGES, "quiet", "a join", "GPU bound x", "quiet x"]
    return format_table(headers, rows)


def plot(cells: Sequence[UpCell], path: Path, title: str) -> None:
    series: dict[str, dict[str, float]] = {}
    for c in sorted(cells, key=lambda c: (c.workload, c.batch, c.door)):
        group = f"{c.workload}\nbatch {c.batch}, {c.door}"
        series.setdefault(c.config, {})[group] = c.speedup or 0.0
    grouped_bars(series, path, title, "x over tier 0 (the target alone)", baseline=1.0)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_pair_args(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 32],
                        help="requests per cell: one count, or one per batch")  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--top-p", type=float, default=0.95, help="of the sampled workloads")
    parser.add_argument("--tiers", type=int, nargs="*", default=[7], help="pinned, beside 0")
    parser.add_argument("--max-batch", type=int, help="`up --max-batch` (default: up's)")
    parser.add_argument("--policy", type=Path, help="`up --policy` (default: up's)")
    parser.add_argument(
        "--feature-dtype",
        choices=[d.value for d in FeatureDType],
        default=FeatureDType.AUTO.value,
        help="`up --feature-dtype`",
    )
    parser.add_argument(
        "--feature-ring-mib", type=int, help="`up --feature-ring-mib` (0: features as bytes)"
    )
    parser.add_argument(
        "--draft-window", type=int, help="`up --draft-window` (0: the whole history)"
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        nargs=2,
        default=(96, 128),
        metavar=("LO", "HI"),
        help="the code prompts' lengths (default: 96 128)",
    )
    parser.add_argument(
        "--distinct-prompts",
        type=int,
        default=8,
        help="code prompts, repeated to each cell's requests (default: %(default)s)",
    )
    add_lab_arg(parser, "feed_draft_at_tier_0=1")
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["goodput", "verbatim"],
        help="configurations left out",
    )
    parser.add_argument(
        "--variant",
        nargs="+",
        metavar="KEY=VALUE",
        help="one more configuration: the sglang kind with these keys changed",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="run every cell once unrecorded first (the first config otherwise pays each "
        "batch size's first waves: on an H200 its rounds ran 10-16 %% slower at 8-64 clients)",
    )
    parser.add_argument("--doors", nargs="+", choices=DOORS, default=list(DOORS))
    turns = "turns over every configuration, in order, then backwards, …; pooled"
    parser.add_argument("--repeats", type=int, default=2, help=turns)
    parser.add_argument("--token-map", type=Path, metavar="FILE",
                        help="`up --draft-token-map` (an EAGLE-1/2 head)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/out/up_client.json"))
    args = parser.parse_args(argv)
    counts = request_counts(parser, args.batches, args.requests)
    if args.variant:
        try:
            policy_changes(args.variant)  # `ctl policy`'s parse: a bad one fails before `up`
        except ValueError as exc:
            parser.error(f"--variant {' '.join(args.variant)}: {exc}")
    if args.policy and args.repeats > 1:
        parser.error(
            "--repeats N > 1 runs each configuration N times, and --policy's can only run as "
            "up started it, once"
        )
    from transformers import AutoTokenizer

    info = device_info()
    print(f"device: {info}", flush=True)
    target, draft = bench_pair(args.shape, args.models_dir, args.draft_kind, args.device)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    workloads = [
        wl for wl in make_workloads(tokenizer, max(counts.values()), args.temperatures,
                                    args.top_p, args.prompt_tokens, args.distinct_prompts)
        if wl.prompts == "code"
    ]  # fmt: skip
    # the pins come last: SGLang's rule lists no tier 0, the goodput kind does (`apply`)
    first = "policy" if args.policy else "sglang"  # up's own, or the one given
    variant = ["sglang " + " ".join(args.variant)] if args.variant else []
    configs = [first, *variant, "verbatim", "goodput", "tier 0", *(f"tier {t}" for t in args.tiers)]
    configs = [c for c in configs if c.split()[0] not in args.skip]
    command = up_command(args, target, draft)
    pooled: Cells = {}  # each cell once, in the order of its first run; later turns add to it

    def save() -> None:
        cells = list(pooled.values())
        fill_ratios(cells)
        write_json(args.out, {
            "device": info, "date": time.strftime("%Y-%m-%d"), "command": command,
            "draft_kind": args.draft_kind, "shape": args.shape, "new_tokens": args.new_tokens,
            "requests": counts, "token_map": args.token_map and str(args.token_map),
            "repeats": args.repeats, "lab": args.lab, "feature_dtype": args.feature_dtype,
            "feature_ring_mib": args.feature_ring_mib, "draft_window": args.draft_window,
            "prompt_tokens": list(args.prompt_tokens),
            "policy": args.policy and json.loads(args.policy.read_text()),
            "cells": [asdict(c) | {"tokens_per_s": c.tokens_per_s, "spread": c.spread,
                                   "steady_tokens_per_s": c.steady_tokens_per_s,
                                   "ttft_ms": c.ttft_ms, "wire_ms": c.wire_ms}
                      for c in cells],
        })  # fmt: skip

    def record(cell: UpCell) -> None:
        line = f"{cell.config:8s} {cell.door:6s} {cell.workload:18s} batch {cell.batch:2d}"
        print(f"  {line} {cell.tokens_per_s:8.1f} tok/s ({len(cell.runs)} runs)", flush=True)
        save()

    lab = lab_env(lab_fields(args.lab))
    with running_up(command, args.out.with_suffix(".log"), env_changes=lab) as up:
        wait_draft_connected(SpecpairClient(up.target, timeout=60))
        ctl = ControllerClient(up.controller, token=up.token, timeout=30)
        if args.warm:  # every batch size once, unrecorded: first shapes' kernels, buckets
            run_cells(
                up, "warm", workloads, counts, args.new_tokens, args.doors, {}, lambda c: None
            )
        for turn in range(args.repeats):
            for config in turn_order(configs, turn):
                print(config, flush=True)
                apply(ctl, config, afresh=turn > 0)
                doors = turn_order(args.doors, turn)  # neither door always runs first
                run_cells(up, config, workloads, counts, args.new_tokens, doors, pooled, record)
    save()
    cells = list(pooled.values())
    gpu = info.get("gpu", info["cpu"])
    plot(cells, args.out.with_suffix(".png"), f"specpair up, {args.draft_kind}, {gpu}")
    print(f"\nwrote {args.out}\n")
    print("rounds (ms a round, means; the last run of each cell):")
    print(render_anatomy(cells) + "\n")
    print(render(cells))


if __name__ == "__main__":
    main()
