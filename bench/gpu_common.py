"""What the GPU benchmarks share: Llama-3-8B-shaped random models built on the GPU, the copy
bandwidth ceiling, CUDA-event timing. Nothing is saved to disk."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from bench.common import median
from specpair.models.args import ModelArgs
from specpair.models.eagle import EagleHead
from specpair.models.llama import LlamaModel
from specpair.models.rope import rope_inv_freq

LLAMA3_ROPE = (
    ("factor", 8.0),
    ("high_freq_factor", 4.0),
    ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 8192),
    ("rope_type", "llama3"),
)
LLAMA3_8B = ModelArgs(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    rope_scaling=LLAMA3_ROPE,
)
# ~1.2B: Llama-3.2-1B's widths with 16 heads of 128 (flashinfer kernels shared with the target).
DRAFT_1B = ModelArgs(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rope_scaling=LLAMA3_ROPE,
)


def random_llama(args: ModelArgs, seed: int = 0) -> LlamaModel:
    """Random bf16 weights (std 0.02; norms 1), built directly on the GPU."""
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaModel(args)
    finally:
        torch.set_default_dtype(default)
    _randomize(model)
    model.inv_freq = rope_inv_freq(args).cuda()
    return model.eval()


def random_eagle(target: LlamaModel, seed: int = 1) -> EagleHead:
    """An EAGLE head at the target's width: one decoder layer + fc, sharing embedding/LM head."""
    torch.manual_seed(seed)
    args = replace(target.args, num_layers=1)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            head = EagleHead(args, target.args)
        head.fc.to_empty(device="cuda")
        head.layers.to_empty(device="cuda")
    finally:
        torch.set_default_dtype(default)
    head.embed_tokens, head.lm_head = target.model.embed_tokens, target.lm_head
    _randomize(head.fc)
    _randomize(head.layers)
    head.inv_freq = rope_inv_freq(args).cuda()
    return head.eval()


def _randomize(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)


def weight_bytes(module: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def time_cuda(fn: Callable[[], Any], iters: int, warmup: int = 3) -> list[float]:
    """Seconds per call from CUDA events, one pair per call (host work inside `fn` included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def copy_bandwidth(gib: float = 4.0, iters: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (the memory ceiling)."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    seconds = median(time_cuda(lambda: dst.copy_(src), iters))
    return 2 * n * 2 / seconds


def build_pair(draft: str, max_batch: int, buckets: list[int], tiers: list[int], max_len: int):  # type: ignore[no-untyped-def]
    """8B target + a drafter ("eagle", "1b", "identical", "none"), graphs captured per tier."""
    from specpair.runtime.build import build_states

    worker, drafter = pair_workers(draft, max_batch, max_len)
    t0 = time.perf_counter()
    states = build_states(tiers, worker, drafter, buckets=buckets)
    capture_s = time.perf_counter() - t0
    return worker, drafter, states, capture_s


def pair_workers(draft: str, max_batch: int, max_len: int):  # type: ignore[no-untyped-def]
    """The workers of `build_pair`, fused, before any state is built."""
    from specpair.runtime.build import gpu_drafter, gpu_target
    from specpair.runtime.draft.drafters import EagleDrafter, LMDrafter
    from specpair.runtime.gpu.fused import fuse_decoder
    from specpair.runtime.kv_cache import KVCache
    from specpair.runtime.target.worker import TargetWorker

    def cache(args: ModelArgs) -> KVCache:
        return KVCache.for_model(
            args, max_requests=max_batch, max_len=max_len, dtype=torch.bfloat16, device="cuda"
        )

    model = random_llama(LLAMA3_8B)
    worker = TargetWorker(model, cache(LLAMA3_8B), keep_features=draft == "eagle")
    gpu_target(worker)
    drafter: Any = None
    if draft == "eagle":
        fuse_decoder(model)
        head = random_eagle(model)
        drafter = EagleDrafter(head, cache(head.args))
    elif draft == "1b":
        small = random_llama(DRAFT_1B, seed=2)
        drafter = LMDrafter(small, cache(DRAFT_1B))
    elif draft == "identical":
        drafter = LMDrafter(model, cache(LLAMA3_8B))
    if drafter is not None:
        gpu_drafter(drafter)
    return worker, drafter


@dataclass
class RoundTimes:
    extend: list[float] = field(default_factory=list)
    draft: list[float] = field(default_factory=list)
    verify: list[float] = field(default_factory=list)
    other: list[float] = field(default_factory=list)  # bookkeeping after verify (features)
    tokens: list[int] = field(default_factory=list)  # tokens produced per round (all requests)

    def round_s(self) -> float:
        return median(
            [
                e + d + v + o
                for e, d, v, o in zip(self.extend, self.draft, self.verify, self.other, strict=True)
            ]
        )


class RoundLoop:
    """The engine's rounds one at a time (`InProcessRounds`), timed per stage (perf_counter
    around synced work).

    Requests are prefilled at construction and never finish, so a tier can change between any
    two rounds of the same requests, as ApplyTier does.
    """

    def __init__(self, worker: Any, drafter: Any, prompts: list[list[int]]) -> None:
        from specpair.runtime.engine import GREEDY, InProcessRounds
        from specpair.runtime.target.worker import TargetSequence

        self.worker, self.drafter = worker, drafter
        self.seqs = [TargetSequence(f"r{i}", p, GREEDY, 10**9) for i, p in enumerate(prompts)]
        self.rounds = InProcessRounds(worker, drafter)
        self.rounds.prefill(self.seqs)
        self.produced = 0  # tokens of the round just run
        if drafter is not None:
            drafter.profile = True

    async def next_round(self, done: Any) -> None:  # `Batcher`: one round at a time
        return None

    async def awaiting_draft(self, flight: Any, answer: Awaitable[Any]) -> Any:
        return await answer  # a fixed batch: nobody to admit

    def stream(self, seq: Any, result: Any, drafted: bool, steps: int) -> None:
        self.produced += len(result.new_tokens)

    def start(self, state: Any) -> Any:
        """A round's request built and drafted, as served (`finish` verifies it)."""
        return self.rounds.start(self.seqs, state, [state.tier] * len(self.seqs))

    def finish(self, flight: Any) -> None:
        """The started round verified, accepted and committed."""
        self.rounds.finish(flight, self)

    def step(self, state: Any) -> tuple[float, float, float, float, int]:
        """One round: (extend s, draft s, verify s, accept s, tokens produced)."""
        torch.cuda.synchronize()
        self.produced = 0
        t0 = time.perf_counter()
        flight = self.start(state)
        self.finish(flight)
        t3 = time.perf_counter()
        ext = self.drafter.last_times[0] if self.drafter is not None else 0.0
        draft = flight.sent - t0 - ext
        return ext, draft, flight.verified - flight.sent, t3 - flight.verified, self.produced

    def close(self) -> None:
        for seq in self.seqs:
            self.rounds.release(seq)


def run_rounds(
    worker: Any, drafter: Any, state: Any, prompts: list[list[int]], rounds: int
) -> RoundTimes:
    """`rounds` rounds of fresh requests at one tier (the first ones include the prompt extend)."""
    loop = RoundLoop(worker, drafter, prompts)
    times = RoundTimes()
    for _ in range(rounds):
        ext, dra, ver, oth, produced = loop.step(state)
        times.extend.append(ext)
        times.draft.append(dra)
        times.verify.append(ver)
        times.other.append(oth)
        times.tokens.append(produced)
    loop.close()
    return times
