"""The round's messages: what the target sends the draft, what comes back, what a round cost.

They mirror the protos (`draft.proto`: DraftInput, RoundRequest, RoundResponse;
`common.proto`: StageTimings; `target.proto`: RoundStats) and `specpair.rpc.wire` converts
whole messages, so that the two sides' rounds (`target/target_round.py`,
`draft/draft_round.py`), the controller and the benchmarks exchange these types and never a
proto. No grpc here.

One round at tier s, for a batch of requests:

    target ── RoundRequest(round_id, s, inputs=[DraftInput per request], released ids) ──▶ draft
    target ◀── RoundResponse(round_id, trees={request id: CandidateTree}, timings, error) ── draft
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specpair.runtime.feature_rows import FeatureRows
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.shape import TreeShape
from specpair.runtime.tree import CandidateTree


@dataclass(frozen=True, slots=True)
class DraftInput:
    """One request of a round: what the target appended since the previous round."""

    request_id: str
    appended: tuple[int, ...]  # ends with the pending (bonus) token
    sampling: SamplingParams
    # [n, H] target hidden states of the positions committed since the last round; row i
    # predicted appended[len(appended) - n + i]. EAGLE only; float8 from a remote target
    # sending them so (`Fp8Rows`, dequantized on the draft's device where they are placed).
    features: FeatureRows | None = None
    steps: int = 0  # tokens to draft for this request; 0: the round's speculative_num_steps
    # the draft holds it already (a hand-off ahead of this round, its answer unread): a draft
    # that does not refuses the input rather than start the request from `appended`
    continues: bool = False


@dataclass(frozen=True, slots=True)
class RoundRequest:
    """target → draft: extend each request with its appended tokens, then draft
    `speculative_num_steps` tokens for it (or its own `steps`, never more). Releases come first,
    also without inputs."""

    round_id: int
    speculative_num_steps: int  # the tier of this round: its state, the largest input's steps
    inputs: tuple[DraftInput, ...] = ()
    released_request_ids: tuple[str, ...] = ()  # finished or cancelled: free their state
    shape: TreeShape | None = None  # the round's tier when a tree (its steps: the int above)

    @property
    def tier(self) -> TreeShape:
        return self.shape or TreeShape(self.speculative_num_steps)


@dataclass(frozen=True, slots=True)
class StageTimings:
    """Milliseconds per stage of one round (fields as in common.proto's StageTimings)."""

    draft_ms: float = 0.0
    extend_ms: float = 0.0
    verify_ms: float = 0.0
    rpc_ms: float = 0.0  # round trip to the draft minus its own time: serialization + gRPC
    schedule_ms: float = 0.0  # admission, prefill bookkeeping, streaming results
    total_ms: float = 0.0
    wait_ms: float = 0.0  # the target waited for the draft's messages
    admit_ms: float = 0.0  # prefill of the requests joining the round (in total, not schedule)
    handoff_ms: float = 0.0  # of admit_ms: the joiners' prompts to the draft, and its answer
    draft_host_ms: float = 0.0  # the draft service's event loop and thread hand-offs
    draft_gpu_ms: float = 0.0  # CUDA graph replays, from CUDA events; 0 when none ran
    verify_gpu_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class RoundResponse:
    """draft → target: a tree per request it drafted. A request without a tree was not kept
    by the draft (no room), so the target re-sends its whole history later."""

    round_id: int
    trees: dict[str, CandidateTree] = field(default_factory=dict)
    timings: StageTimings = StageTimings()
    # The whole round was refused (e.g. an unknown tier): the draft dropped every input's state.
    error: str = ""
    # Trees that arrived but could not be decoded, with why: they cost only their request.
    malformed: dict[str, str] = field(default_factory=dict)
    # Requests the draft kept nothing for, with why (`RESOURCE_EXHAUSTED: … max_target_requests`).
    refused: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RoundStats:
    """The target's account of one finished round, streamed to WatchRounds (the controller)."""

    round_id: int
    speculative_num_steps: int
    batch_size: int
    accept_lengths: tuple[int, ...]  # per drafted request (bonus excluded); () without drafts
    speculative: bool
    timings: StageTimings
    unix_time: float
    # Parallel to accept_lengths: whose each one is, and the tier that request ran at.
    request_ids: tuple[str, ...] = ()
    request_steps: tuple[int, ...] = ()
    plain_request_ids: tuple[str, ...] = ()  # the batch's requests that got no draft
    sampled_requests: int = 0  # requests of the batch that sample (temperature > 0)
    shape: TreeShape | None = None  # the round's tier when a tree (its steps: the int above)
    verify_rows: int = 0  # rows the verify computed: a graph's bucket × tokens (0: unknown)

    @property
    def tier(self) -> TreeShape:
        return self.shape or TreeShape(self.speculative_num_steps)
