"""`bench.up_client`'s steady window (a cell's tokens/s while every client had a request in
flight, without the drain after the last request started), its GPU-work bound, and what it
reads of the target's exporter (time to first token, latency)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from bench.common import free_port
from bench.up_client import (
    Served,
    UpCell,
    fill_ratios,
    gpu_bound,
    join_costs,
    main,
    quiet_x,
    render,
    share_at,
    slowest,
    steady,
    turn_order,
)
from specpair.rpc.metrics import ServiceMetrics
from specpair.runtime.round_messages import RoundStats, StageTimings


def test_the_window_ends_at_the_last_start_and_counts_tokens_by_time_inside_it() -> None:
    # clients A: 0-10 s, 10-20 s and B: 0-15 s, 15-30 s, 100 tokens each (the docstring's)
    spans = [(0.0, 10.0, 100), (10.0, 20.0, 100), (0.0, 15.0, 100), (15.0, 30.0, 100)]
    tokens, seconds = steady(spans, 0.0)
    assert seconds == 15.0
    assert tokens == pytest.approx(100 + 50 + 100 + 0)


def test_a_drain_tail_lowers_the_cell_but_not_the_window() -> None:
    """Two clients, 3 requests each at 10 tok/s; one of them gets a long last request. The
    whole run's rate falls with the tail; the window's stays the pace the server kept."""
    even = [(0, 10, 100), (10, 20, 100), (20, 30, 100), (0, 10, 100), (10, 20, 100), (20, 30, 100)]
    tail = [*even[:5], (20, 60, 400)]
    for spans in (even, tail):
        tokens, seconds = steady([(float(s), float(e), k) for s, e, k in spans], 0.0)
        assert tokens / seconds == pytest.approx(20.0)
    whole_even = sum(k for *_, k in even) / 30
    whole_tail = sum(k for *_, k in tail) / 60
    assert whole_even == pytest.approx(20.0) and whole_tail == pytest.approx(15.0)


def test_steady_ratios_pair_cells_as_the_whole_ones_do() -> None:
    alone = UpCell(
        "tier 0", "sdk", "code greedy", 8, 800, 10.0, steady_tokens=700, steady_seconds=7.0
    )
    spec = UpCell(
        "tier 7", "sdk", "code greedy", 8, 1600, 10.0, steady_tokens=1500, steady_seconds=5.0
    )
    one_wave = UpCell("sglang", "sdk", "code greedy", 8, 800, 4.0)  # no window: n == batch
    fill_ratios([alone, spec, one_wave])
    assert spec.speedup == pytest.approx(2.0) and spec.steady_speedup == pytest.approx(3.0)
    assert one_wave.speedup == pytest.approx(2.5) and one_wave.steady_speedup is None


def test_the_gpu_bound_worked_example_and_where_it_has_none() -> None:
    alone = {"total": 7.04, "verify_gpu": 4.87, "accept": 0.0}
    ours = {"total": 16.37, "verify_gpu": 5.79, "draft_gpu": 4.73, "accept": 2.34}
    assert gpu_bound(ours, alone) == pytest.approx(3.34 * 7.04 / 12.69)
    assert gpu_bound(ours, alone) == pytest.approx(1.85, abs=0.01)
    assert gpu_bound({**ours, "draft_gpu": 0.0}, alone) is None  # a CPU run: no graphs
    assert gpu_bound({**ours, "accept": 0.0}, alone) is None  # nothing drafted
    assert gpu_bound(ours, {}) is None
    cells = [
        UpCell("tier 0", "sdk", "code T=0.7", 8, 700, 1.0, rounds=alone),
        UpCell("tier 7", "sdk", "code T=0.7", 8, 1200, 1.0, rounds=ours),
    ]
    fill_ratios(cells)
    assert cells[1].gpu_bound == pytest.approx(1.85, abs=0.01) and cells[0].gpu_bound is None


def test_the_quiet_x_worked_example_and_where_it_has_none() -> None:
    alone = {"quiet_total": 6.72, "batch": 7.84, "accept": 0.0}
    ours = {"quiet_total": 11.59, "batch": 7.23, "accept": 4.42}
    assert quiet_x(ours, alone) == pytest.approx(5.42 * 6.72 / 11.59 * 7.23 / 7.84)
    assert quiet_x(ours, alone) == pytest.approx(2.90, abs=0.01)
    assert quiet_x({**ours, "accept": 0.0}, alone) is None  # nothing drafted
    assert quiet_x({**ours, "quiet_total": 0.0}, alone) is None  # every round joined
    assert quiet_x(ours, {}) is None
    cells = [
        UpCell("tier 0", "sdk", "code greedy", 8, 1100, 1.0, rounds=alone),
        UpCell("tier 7", "sdk", "code greedy", 8, 2800, 1.0, rounds=ours),
    ]
    fill_ratios(cells)
    assert cells[1].quiet_x == pytest.approx(2.90, abs=0.01) and cells[0].quiet_x is None


def test_turns_run_the_configurations_forward_then_backward() -> None:
    configs = ["sglang", "tier 0", "tier 7"]
    assert [turn_order(configs, t) for t in range(3)] == [configs, configs[::-1], configs]


def test_a_policy_file_runs_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`up --policy FILE`'s policy cannot be set again between turns: more than one is refused
    before anything starts."""
    policy = tmp_path / "policy.json"
    policy.write_text("{}")
    with pytest.raises(SystemExit):
        main(["--policy", str(policy), "--repeats", "2"])
    assert "--repeats N > 1" in capsys.readouterr().err


def test_a_cells_ttft_wire_and_undrafted_rounds_come_from_the_targets_exporter() -> None:
    metrics = ServiceMetrics("target")
    port = free_port()
    metrics.serve("127.0.0.1", port)
    address = f"127.0.0.1:{port}"
    metrics.ttft.observe(9.0)  # before the cell: not its own
    metrics.request_latency.observe(9.0)
    metrics.fallback_rounds.labels("draft_error").inc()
    draft, draft_port = ServiceMetrics("draft"), free_port()
    draft.serve("127.0.0.1", draft_port)
    draft_address = f"127.0.0.1:{draft_port}"
    before = Served.read(address, draft_address)
    gc.collect()  # a full collection in the cell: both exporters count this process's
    for ttft, latency in ((0.010, 0.200), (0.030, 0.400)):
        metrics.ttft.observe(ttft)
        metrics.request_latency.observe(latency)
    # request-rounds without drafts, every reason summed: two refused (no slot), one late
    metrics.fallback_rounds.labels("draft_refused").inc(2)
    metrics.fallback_rounds.labels("draft_timeout").inc()
    metrics.tier_switches.inc(4)
    for path, n in (("greedy", 5), ("graph", 3), ("device", 1)):  # where verifies accepted
        metrics.accepts.labels(path).inc(n)
    cell = UpCell("tier 7", "sdk", "code greedy", 2, 256, 1.0)
    cell.served += Served.read(address, draft_address) - before
    cell.client_s, cell.requests = 0.205 + 0.415, 2  # each call 5 / 15 ms beyond its latency
    assert cell.ttft_ms == pytest.approx(20.0)
    assert cell.wire_ms == pytest.approx(10.0)
    assert cell.served.undrafted == 3
    assert cell.served.switches == 4
    assert cell.served.gc_s > 0 and cell.served.draft_gc_s > 0
    assert (cell.served.eager_accepts, cell.served.accepts) == (1, 9)
    assert render([cell]).splitlines()[-1].split()[-11:-9] == ["3", "4"]
    assert render([cell]).splitlines()[-1].split()[-3:] == ["1", "/", "9"]
    assert Served.read("") == Served()  # no exporter: nothing read, no means
    assert UpCell("tier 7", "sdk", "code greedy", 2, 0, 1.0).ttft_ms is None


def test_the_share_at_a_tier_counts_drafted_request_rounds_by_their_own_tier() -> None:
    def stats(
        steps: int, accepts: tuple[int, ...], request_steps: tuple[int, ...] = ()
    ) -> RoundStats:
        return RoundStats(
            round_id=0,
            speculative_num_steps=steps,
            batch_size=len(accepts),
            accept_lengths=accepts,
            speculative=steps > 0,
            timings=StageTimings(),
            unix_time=0.0,
            request_steps=request_steps,
        )

    # the docstring's example: batches of 2, 2 at 7 and 4 at 3; a tier-0 round counts nothing
    rounds = [stats(7, (1, 2)), stats(7, (0, 7)), stats(3, (1, 1, 3, 0)), stats(0, ())]
    assert share_at(rounds, 7) == 0.5
    assert share_at(rounds, 3) == 0.5
    # a request's own tier, where the round names one, is the one counted
    assert share_at([stats(7, (1, 2), request_steps=(7, 3))], 7) == 0.5
    assert share_at([stats(0, ())], 7) == 0.0


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        (["cost_guard"], "policy change 'cost_guard' must be KEY=VALUE"),
        (["bogus=1"], "unknown policy key 'bogus'"),
        (["cost_guard=maybe"], "cost_guard: expected true or false"),
    ],
)
def test_a_bad_variant_is_refused_before_up_starts(
    variant: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["--variant", *variant])
    assert message in capsys.readouterr().err


def test_the_slowest_rounds_are_kept_whole_slowest_first() -> None:
    def stats(round_id: int, total: float, admit: float) -> RoundStats:
        return RoundStats(
            round_id=round_id,
            speculative_num_steps=7,
            batch_size=32,
            accept_lengths=(4,) * 32,
            speculative=True,
            timings=StageTimings(total_ms=total, admit_ms=admit),
            unix_time=100.0 + round_id,
        )

    rounds = [stats(1, 30.0, 10.0), stats(2, 120.0, 90.0), stats(3, 25.0, 0.0), stats(4, 31.0, 0)]
    kept = slowest(rounds, 100.0, n=2)
    assert [r["round_id"] for r in kept] == [2.0, 4.0]
    assert kept[0]["admit"] == 90.0 and kept[0]["total"] == 120.0 and kept[0]["at_s"] == 2.0
    assert kept[0]["steps"] == 7.0 and kept[0]["batch"] == 32.0
    assert slowest([], 0.0) == []


def test_a_join_costs_the_time_its_rounds_took_over_the_quiet_ones() -> None:
    def stats(total: float, admit: float, ids: tuple[str, ...]) -> RoundStats:
        return RoundStats(
            round_id=0,
            speculative_num_steps=7,
            batch_size=len(ids),
            accept_lengths=(4,) * len(ids),
            speculative=True,
            timings=StageTimings(total_ms=total, admit_ms=admit),
            unix_time=0.0,
            request_ids=ids,
        )

    # the docstring's example: quiet rounds of 10 ms, one of 30 ms that admitted b and c
    rounds = [stats(10.0, 0.0, ("a",)), stats(30.0, 12.0, ("a",)), stats(10.0, 0.0, ("a", "b"))]
    rounds.append(stats(10.0, 0.0, ("a", "b", "c")))
    costs = join_costs(rounds)
    assert costs["quiet_total"] == 10.0 and costs["joining_total"] == 30.0
    assert costs["joining_share"] == 0.25
    assert costs["a_join"] == 20.0 / 3  # a, b and c each first show in this cell
    assert join_costs(rounds[:1]) == {}  # no joining round: nothing to say
