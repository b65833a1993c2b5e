"""A Llama decoder split over N ranks, Megatron-style: one rank's shard of every layer.

Each rank holds heads / N attention heads and KV heads and intermediate / N MLP columns:

    q/k/v_proj, gate/up_proj  column-parallel: this rank's rows of the weight (its heads, its
                              intermediate columns); no communication
    o_proj, down_proj         row-parallel: this rank's input columns; the partial outputs are
                              summed over the ranks (one all-reduce per attention, one per MLP),
                              then the bias is added once
    lm_head                   vocab-parallel: this rank's ceil(V / N) vocabulary rows (the last
                              rank's padded with zeros); the logits shards are all-gathered
    embedding, norms          replicated

So the residual stream is the same on every rank after each layer, and every rank's KV cache
holds only its own KV heads. 4 heads, 2 KV heads, N = 2: rank 1 runs q heads 2-3 over KV head 1
(a q head h reads KV head h // 2, so contiguous chunks keep GQA's groups whole).

Collectives go through the default process group (`torch.distributed`), which the caller
has initialised (`specpair/parallel/ranks.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from specpair.models.args import ModelArgs
from specpair.models.llama import DecoderLayer, LlamaModel
from specpair.models.loading import CheckpointError, Index, Read, llama_args, read_llama
from specpair.models.rope import rope_inv_freq


@dataclass(frozen=True, slots=True)
class Shard:
    rank: int
    world: int  # ranks the model is split over

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not in [0, {self.world})")

    def chunk(self, n: int) -> slice:
        """This rank's part of n items (n divisible by world)."""
        per = n // self.world
        return slice(self.rank * per, (self.rank + 1) * per)


def check_shardable(args: ModelArgs, world: int, path: str | Path = "config.json") -> None:
    """Refuses a model whose heads or MLP do not split evenly over `world` ranks, naming the
    config field (the vocabulary need not: the LM head pads)."""
    for field, value in (
        ("num_attention_heads", args.num_heads),
        ("num_key_value_heads", args.num_kv_heads),
        ("intermediate_size", args.intermediate_size),
    ):
        if value % world:
            raise CheckpointError(
                f"{path}: {field} ({value}) is not divisible by --tensor-parallel {world}"
            )


# torch 2.13 renamed all_gather_into_tensor (deprecated there); the GPU images run 2.11
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Collectives:
    """How many collectives this process has issued: a graph whose capture issued one must be
    replayed by every rank together (`runtime/gpu/capture.py`), one that issued none (a
    sampled accept over the gathered logits) is rank 0's alone."""

    issued = 0


class PeerReduce:
    """A one-shot all-reduce over peer memory for small sums: each rank copies its partial into
    a buffer every rank of the node has mapped (torch symmetric memory over NVLink P2P, no
    multicast), waits at a barrier, then reads and adds every rank's copy itself, so a sum is
    one kernel of a few microseconds instead of NCCL's ring (about 15-20 us inside a graph at
    8 rows x 4096 on two H200s, 64 of them a forward: issue 52's measurement). Above
    `max_bytes` each rank reading every peer's whole buffer costs more than the ring saves, so
    bigger sums (prefill chunks) stay on NCCL.

    The kernel (`symm_mem.one_shot_all_reduce_copy_out`) ends with a second barrier, so the
    one buffer is safe to reuse by the next sum on the same stream, inside a CUDA graph too."""

    def __init__(self, device: torch.device, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name  # type: ignore[union-attr]
        self.max_numel = max_bytes // 4  # float32: `reduced` sums in float32
        self.buffer = symm_mem.empty(self.max_numel, dtype=torch.float32, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)  # collective: every rank maps each

    def fits(self, x: Tensor) -> bool:
        return x.dtype == torch.float32 and x.numel() <= self.max_numel and x.is_contiguous()

    def __call__(self, x: Tensor) -> Tensor:
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(
            self.buffer[: x.numel()], x.view(-1), "sum", self.group_name, out.view(-1)
        )
        return out


PEER_REDUCE_MAX_BYTES = 1 << 20  # 64 rows of 4096 float32: a batch-8 tier-7 verify
_peer: PeerReduce | None = None


def start_peer_reduce(device: torch.device, max_bytes: int = PEER_REDUCE_MAX_BYTES) -> str:
    """Maps this rank's peer-reduce buffer (collective: every rank of the group calls it, after
    NCCL's group is up); '' once mapped, else why not (then sums go through NCCL)."""
    global _peer
    try:
        _peer = PeerReduce(device, max_bytes)
    except Exception as exc:  # no P2P between the GPUs, a torch without symmetric memory
        _peer = None
        return f"{type(exc).__name__}: {exc}"
    return ""


def stop_peer_reduce() -> None:
    """Back to NCCL for every sum (each rank: when one rank could not map its buffer)."""
    global _peer
    _peer = None


def reduce_sum(x: Tensor) -> Tensor:
    """Sums `x` over the ranks (a test replaces it with a broken one, which the distribution
    test must catch); in place through NCCL, out of place through peer memory."""
    Collectives.issued += 1
    if _peer is not None and x.is_cuda and _peer.fits(x):
        return _peer(x)
    dist.all_reduce(x)
    return x


def gather_vocab(local: Tensor, world: int, vocab_size: int) -> Tensor:
    """Each rank's logits shard [N, V / world] -> the whole logits [N, V], in rank order and
    cut at the padded rows. One all-gather into one buffer (no list of shards: a CUDA graph
    captures it as one collective)."""
    Collectives.issued += 1
    n, per = local.shape
    out = local.new_empty(world * n, per)
    _all_gather(out, local.contiguous())
    return out.view(world, n, per).transpose(0, 1).reshape(n, world * per)[:, :vocab_size]


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of (x_r @ W_r^T) + b: W_r [out, in / N] takes this rank's part of the
    input (its heads' outputs, its intermediate columns); in_features is that part's."""

    def forward(self, x: Tensor) -> Tensor:
        y = reduce_sum(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelHead(nn.Linear):
    """Logits [..., V] from this rank's [ceil(V / N), H] rows, the shards all-gathered."""

    def __init__(self, vocab_size: int, hidden_size: int, world: int) -> None:
        super().__init__(hidden_size, -(-vocab_size // world), bias=False)
        self.vocab_size, self.world = vocab_size, world

    def forward(self, x: Tensor) -> Tensor:
        local = F.linear(x.reshape(-1, x.shape[-1]), self.weight)  # [N, V / world]
        return gather_vocab(local, self.world, self.vocab_size).view(*x.shape[:-1], -1)


class TensorParallelLlama(LlamaModel):
    """`LlamaModel` with this rank's shard of every layer; built on the meta device and filled
    by `load_shard`. Its forward and LM head are collectives: every rank must run them."""

    def __init__(self, args: ModelArgs, shard: Shard) -> None:
        check_shardable(args, shard.world)
        super().__init__(args)
        self.shard = shard
        for layer in self.model.layers:
            _shard_layer(cast(DecoderLayer, layer), args, shard.world)
        self.lm_head = VocabParallelHead(args.vocab_size, args.hidden_size, shard.world)


def _shard_layer(layer: DecoderLayer, args: ModelArgs, n: int) -> None:
    """Replaces a layer's projections with one rank's (of n), uninitialised."""
    attn, mlp, hidden = layer.self_attn, layer.mlp, args.hidden_size
    attn.n_heads, attn.n_kv = args.num_heads // n, args.num_kv_heads // n
    q, kv = attn.n_heads * args.head_dim, attn.n_kv * args.head_dim
    attn.q_proj = nn.Linear(hidden, q, bias=args.qkv_bias)
    attn.k_proj = nn.Linear(hidden, kv, bias=args.qkv_bias)
    attn.v_proj = nn.Linear(hidden, kv, bias=args.qkv_bias)
    attn.o_proj = RowParallelLinear(q, hidden, bias=args.o_bias)
    inter = args.intermediate_size // n
    mlp.gate_proj = nn.Linear(hidden, inter, bias=args.mlp_bias)
    mlp.up_proj = nn.Linear(hidden, inter, bias=args.mlp_bias)
    mlp.down_proj = RowParallelLinear(inter, hidden, bias=args.mlp_bias)


COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # weight and bias: rows
ROW = ("o_proj.weight", "down_proj.weight")  # input columns; their biases are whole


def part(name: str, shape: Sequence[int], shard: Shard) -> Index:
    """Which part of the full tensor `name` (HF names) of `shape` this rank holds. World 2:
    q_proj [4096, 4096] -> rows 2048:4096 on rank 1; o_proj [4096, 4096] -> [:, 2048:4096];
    lm_head [7, H] -> rows 4:8, of which only 4:7 exist (`take_part` pads); norms -> ()."""
    module = name.split(".")[-2]  # model.layers.0.self_attn.q_proj.weight: q_proj
    if module in COLUMN:
        return (shard.chunk(shape[0]),)
    if name.endswith(ROW):
        return (slice(None), shard.chunk(shape[1]))
    if name == "lm_head.weight":
        per = -(-shape[0] // shard.world)
        return (slice(shard.rank * per, (shard.rank + 1) * per),)
    return ()


def take_part(name: str, shape: torch.Size, read: Read, *, shard: Shard) -> Tensor:
    """Reads this rank's part of tensor `name`, as `TensorParallelLlama` holds it: the LM
    head's rows past the vocabulary are zeros (their logits are cut after the gather)."""
    tensor = read(part(name, shape, shard))
    if name == "lm_head.weight":
        per = -(-shape[0] // shard.world)
        tensor = F.pad(tensor, (0, 0, 0, per - len(tensor)))
    return tensor


def shard_state(state: dict[str, Tensor], shard: Shard) -> dict[str, Tensor]:
    """This rank's part of a full model's state dict (HF names)."""
    return {
        name: take_part(name, tensor.shape, tensor.__getitem__, shard=shard).clone()
        for name, tensor in state.items()
    }


M = TypeVar("M", bound=TensorParallelLlama)


def load_shard(
    path: str | Path,
    shard: Shard,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    context: int | None = None,
    make: Callable[[ModelArgs, Shard], M] = TensorParallelLlama,  # type: ignore[assignment]
) -> M:
    """This rank's shard of the checkpoint at `path`, with every check `load_llama` makes; `make`
    builds the model class (rank 0's `LeaderModel`). From safetensors only this rank's part of
    each tensor is read (`get_slice`), cast and moved to `device` before the next, so a rank's
    host memory peaks near its largest tensor (on the CPU: its shard), never the whole model;
    pickled `.bin` checkpoints are read whole first."""
    path = Path(path)
    args = llama_args(path, context)
    check_shardable(args, shard.world, path / "config.json")
    with torch.device("meta"):
        model = make(args, shard)
    take = functools.partial(take_part, shard=shard)
    tensors = read_llama(path, args, dtype=dtype, device=device, take=take)
    model.load_state_dict(tensors, assign=True)
    model.inv_freq = rope_inv_freq(args).to(device)
    return model.to(device).eval()
