"""The target forward at Llama-3-8B's shape, batch 1, q tokens after a context, vs the floor.

    python -m bench.gpu_forward [--contexts 512 2048] [--queries 1 2 4 8] [--out FILE.json]

floor = weight bytes / device-to-device copy bandwidth (read + write), both measured here.
ours: the verify stage as served (fused layers, Triton tree attention over the paged cache,
one CUDA graph); "graph" times the replay, "+plan" adds the host-side planning that precedes it,
"fi-attn" is the same graph with flashinfer's paged prefill in place of the Triton tree attention,
"no-PDL" the same graph with every kernel launched to wait for the one before (`triton_kernels`).
transformers: the same weights (shared tensors), a StaticCache, eager and under a CUDA graph.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import device_info, format_table, write_json
from bench.gpu_common import LLAMA3_8B, copy_bandwidth, median, time_cuda, weight_bytes
from specpair.models.llama import LlamaModel
from specpair.models.rope import rope_inv_freq
from specpair.runtime.gpu.capture import GraphCapture
from specpair.runtime.gpu.fused import fuse_decoder
from specpair.runtime.gpu.verify_graphs import verify_graph
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import BatchLayout


def hf_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    a = LLAMA3_8B
    cfg = LlamaConfig(
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        rms_norm_eps=a.rms_norm_eps,
        max_position_embeddings=a.max_position_embeddings,
        rope_parameters={"rope_theta": a.rope_theta, **dict(a.rope_scaling)},
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    return model.eval()


def ours_from(hf: Any) -> LlamaModel:
    """Our model over the same weight tensors (no copy), then fused (QKV, gate/up concatenated)."""
    with torch.device("meta"):
        model = LlamaModel(LLAMA3_8B)
    model.load_state_dict(dict(hf.state_dict()), strict=True, assign=True)
    model.inv_freq = rope_inv_freq(LLAMA3_8B).cuda()
    return fuse_decoder(model.eval())  # type: ignore[return-value]


def hf_timings(hf: Any, ctx: int, q: int, iters: int) -> dict[str, float]:
    from transformers import StaticCache

    cache = StaticCache(config=hf.config, max_cache_len=ctx + 16)
    prompt = torch.randint(0, LLAMA3_8B.vocab_size, (1, ctx), device="cuda")
    out: dict[str, float] = {}
    with torch.inference_mode():
        hf(prompt, past_key_values=cache, cache_position=torch.arange(ctx, device="cuda"))
        ids = torch.randint(0, LLAMA3_8B.vocab_size, (1, q), device="cuda")
        pos = torch.arange(ctx, ctx + q, device="cuda")
        # transformers 5's StaticLayer ignores `cache_position` on write: it appends at its own
        # device counter `cumulative_length` and advances it, so repeated steps ran past
        # max_cache_len (the `index_copy_` assert). Rewind it to ctx in every step — a device
        # op, so the CUDA graph replays the rewind too and every replay writes ctx .. ctx+q-1.
        counters = [
            layer.cumulative_length
            for layer in getattr(cache, "layers", [])
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
        ]

        def step() -> Any:
            for c in counters:
                c.fill_(ctx)
            return hf(ids, past_key_values=cache, cache_position=pos, position_ids=pos[None]).logits

        out["hf_eager"] = median(time_cuda(step, max(5, iters // 5)))
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            out["hf_graph"] = median(time_cuda(graph.replay, iters))
        except Exception as exc:  # report, don't abort the run
            print(f"transformers CUDA graph failed at ctx {ctx} q {q}: {exc!r}")
            out["hf_graph"] = float("nan")
    return out


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_forward.json"))
    args = parser.parse_args()
    from specpair.runtime.gpu import triton_kernels  # GPU only

    info = device_info()
    print(f"device: {info.get('gpu')}")
    bw = copy_bandwidth()
    hf = hf_model()
    wbytes = weight_bytes(hf)
    floor = wbytes / bw
    print(f"weights {wbytes / 1e9:.2f} GB, copy {bw / 1e12:.2f} TB/s, floor {1e3 * floor:.2f} ms")
    model = ours_from(hf)
    max_ctx = max(args.contexts)
    cache = KVCache.for_model(
        LLAMA3_8B, max_requests=1, max_len=max_ctx + 16, dtype=torch.bfloat16, device="cuda"
    )
    graphs = GraphCapture(cache, 1, "target")
    rows, table = [], []
    for ctx in args.contexts:
        slot = cache.alloc()
        prompt = torch.randint(0, LLAMA3_8B.vocab_size, (1, ctx), device="cuda")
        with torch.inference_mode():
            model(
                prompt,
                torch.arange(ctx, device="cuda")[None],
                cache.bind(BatchLayout.causal([slot], [0], [ctx])),
            )
        cache.commit(slot, 0, range(ctx))
        for q in args.queries:
            t0 = time.perf_counter()
            with torch.inference_mode():
                g = verify_graph(graphs, model, 1, q)
            capture_s = time.perf_counter() - t0
            mask = torch.ones(q, q, dtype=torch.bool).tril()[None]
            layout = BatchLayout(torch.tensor([slot]), torch.tensor([ctx]), mask)
            tokens = torch.randint(0, LLAMA3_8B.vocab_size, (1, q))
            g.inputs["tokens"].copy_(tokens)
            g.inputs["positions"].copy_(torch.arange(ctx, ctx + q)[None])
            g.attention[0].plan(layout)

            def planned(g: Any = g, layout: BatchLayout = layout) -> None:
                g.attention[0].plan(layout)
                g.graph.replay()

            replay = median(time_cuda(g.graph.replay, args.iters))
            with_plan = median(time_cuda(planned, args.iters))
            # the same graph with flashinfer's paged prefill as its attention
            cache.attention.graph_attention = "flashinfer"
            replay_fi = variant_time(graphs, model, layout, tokens, args.iters)
            cache.attention.graph_attention = "triton"
            # and without programmatic dependent launch (each kernel waits for the last)
            triton_kernels.set_pdl(False)
            replay_serial = variant_time(graphs, model, layout, tokens, args.iters)
            triton_kernels.set_pdl(True)
            print(
                f"ours ctx {ctx} q {q}: graph {1e3 * replay:.3f} ms ({replay / floor:.3f}× floor),"
                f" plan+graph {1e3 * with_plan:.3f} ms ({with_plan / floor:.3f}×), "
                f"no PDL {1e3 * replay_serial:.3f} ms, capture {capture_s:.2f} s",
                flush=True,
            )
            hf_t = hf_timings(hf, ctx, q, args.iters)
            # same weights: the logits must agree within bf16 tolerance
            with torch.inference_mode():
                g.graph.replay()
                ours_logits = g.outputs["logits"][0].clone()
                ref = hf(prompt_plus(prompt, tokens)).logits[0, -q:].float()
            rel = float((ours_logits - ref).norm() / ref.norm())
            row = {
                "ctx": ctx,
                "q": q,
                "floor_s": floor,
                "ours_graph_s": replay,
                "ours_plan_graph_s": with_plan,
                "ours_flashinfer_graph_s": replay_fi,
                "ours_no_pdl_graph_s": replay_serial,
                "capture_s": capture_s,
                "logits_rel_err": rel,
                **{k + "_s": v for k, v in hf_t.items()},
            }
            rows.append(row)
            table.append(
                [
                    str(ctx),
                    str(q),
                    f"{1e3 * floor:.2f}",
                    f"{1e3 * replay:.2f}",
                    f"{replay / floor:.3f}",
                    f"{1e3 * with_plan:.2f}",
                    f"{with_plan / floor:.3f}",
                    f"{1e3 * replay_serial:.2f}",
                    f"{replay_serial / floor:.3f}",
                    f"{1e3 * replay_fi:.2f}",
                    f"{replay_fi / floor:.3f}",
                    f"{1e3 * hf_t['hf_eager']:.1f}",
                    f"{1e3 * hf_t['hf_graph']:.2f}",
                    f"{hf_t['hf_graph'] / floor:.2f}",
                    f"{rel:.1e}",
                ]
            )
            del g
        cache.free(slot)
    payload = {"device": info, "copy_bandwidth_Bps": bw, "weight_bytes": wbytes, "rows": rows}
    write_json(args.out, payload)
    print(
        f"\nGPU forward, Llama-3-8B shape, batch 1 — {info.get('gpu')}, "
        f"copy {bw / 1e12:.2f} TB/s, weights {wbytes / 1e9:.2f} GB"
    )
    print(
        format_table(
            [
                "ctx",
                "q",
                "floor ms",
                "ours ms",
                "×floor",
                "+plan ms",
                "×floor",
                "no-PDL ms",
                "×floor",
                "fi-attn ms",
                "×floor",
                "HF eager ms",
                "HF graph ms",
                "HF ×floor",
                "logit err",
            ],
            table,
        )
    )


def variant_time(
    graphs: GraphCapture, model: LlamaModel, layout: BatchLayout, tokens: torch.Tensor, iters: int
) -> float:
    """Captures a fresh verify graph under the current settings, times its replay (seconds)."""
    q = tokens.shape[1]
    start = int(layout.starts[0])
    with torch.inference_mode():
        g = verify_graph(graphs, model, 1, q)
    g.inputs["tokens"].copy_(tokens)
    g.inputs["positions"].copy_(torch.arange(start, start + q)[None])
    g.attention[0].plan(layout)
    return median(time_cuda(g.graph.replay, iters))


def prompt_plus(prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.cat([prompt, tokens.to(prompt.device)], dim=1)


if __name__ == "__main__":
    main()
