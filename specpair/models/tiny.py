"""Tiny random Llama checkpoints in Hugging Face format, deterministic by seed (tests, demos)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedModel

from specpair.models.draft_vocab import d2t_of
from specpair.models.loading import EAGLE_ARCHITECTURE

EOS = "<|endoftext|>"
# A fixed corpus so the tiny tokenizer is the same on every machine.
_TOKENIZER_TEXT = (
    "def main(argv):\n    return 0\n\nclass Config:\n    name: str = 'specpair'\n"
    "import torch\nfor i in range(10):\n    print(i, i * 2)\n"
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts, verifies, accepts."
) * 4


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE of `vocab_size` entries saved so `AutoTokenizer` loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TOKENIZER_TEXT], trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_tiny_llama(
    directory: str | Path,
    *,
    seed: int,
    vocab_size: int = 320,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, float | str] | None = None,
    init_std: float = 0.1,
    tokenizer: bool = True,
) -> Path:
    """Saves a random `LlamaForCausalLM` (and a tokenizer) to `directory`; returns the path.

    `init_std` is larger than HF's 0.02 so the random logits are peaked enough that greedy
    argmax is stable against float rounding (ties would make losslessness tests flaky).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        rope_scaling=rope_scaling,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer:  # a byte-level BPE needs at least 257 entries
        write_tokenizer(directory, vocab_size)
    return directory


def make_tiny_family(
    directory: str | Path,
    config_cls: type[PretrainedConfig],
    model_cls: type[PreTrainedModel],
    *,
    seed: int,
    **config: Any,
) -> Path:
    """A random checkpoint of another `transformers` causal LM of the Llama family (Qwen2,
    Mistral, Llama with biases…) in the tiny shape; biases are drawn nonzero (HF starts them
    at zero, which no test could tell from no bias)."""
    shape: dict[str, Any] = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**shape, **config}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.1)
    model.save_pretrained(directory)
    return Path(directory)


def make_tiny_eagle(directory: str | Path, target: str | Path, *, seed: int) -> Path:
    """A random EAGLE head for the tiny target at `target` (same hidden size and vocabulary)."""
    from safetensors.torch import save_file

    from specpair.models.loading import read_args

    directory, target = Path(directory), Path(target)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(num_hidden_layers=1, architectures=[EAGLE_ARCHITECTURE])
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    args = read_args(target)
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, hd = args.hidden_size, args.intermediate_size, args.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    tensors = {
        "fc.weight": rand(hidden, 2 * hidden),
        "fc.bias": rand(hidden),
        "layers.0.input_layernorm.weight": torch.ones(hidden),
        "layers.0.post_attention_layernorm.weight": torch.ones(hidden),
        "layers.0.self_attn.q_proj.weight": rand(args.num_heads * hd, hidden),
        "layers.0.self_attn.k_proj.weight": rand(args.num_kv_heads * hd, hidden),
        "layers.0.self_attn.v_proj.weight": rand(args.num_kv_heads * hd, hidden),
        "layers.0.self_attn.o_proj.weight": rand(hidden, args.num_heads * hd),
        "layers.0.mlp.gate_proj.weight": rand(inter, hidden),
        "layers.0.mlp.up_proj.weight": rand(inter, hidden),
        "layers.0.mlp.down_proj.weight": rand(hidden, inter),
    }
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def make_tiny_eagle3(
    directory: str | Path,
    target: str | Path,
    *,
    seed: int,
    draft_vocab: int,
    layers: list[int] | None = None,
) -> Path:
    """A random EAGLE-3 head (SafeAILab / SGLang layout) for the tiny target at `target`: its
    lm_head covers `draft_vocab` random target ids through d2t / t2d; `layers` goes to
    `eagle_config.eagle_aux_hidden_state_layer_ids` (None: no key, the default layers)."""
    from safetensors.torch import save_file

    from specpair.models.loading import read_args

    directory, target = Path(directory), Path(target)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(
        num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab
    )
    if layers is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers}
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    args = read_args(target)
    gen = torch.Generator().manual_seed(seed)
    h, inter, hd = args.hidden_size, args.intermediate_size, args.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    used = torch.randperm(args.vocab_size, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(args.vocab_size, dtype=torch.bool)
    t2d[used] = True
    mid = "midlayer."
    tensors = {
        "fc.weight": rand(h, 3 * h),
        f"{mid}hidden_norm.weight": 1 + rand(h),
        f"{mid}input_layernorm.weight": 1 + rand(h),
        f"{mid}post_attention_layernorm.weight": 1 + rand(h),
        f"{mid}self_attn.q_proj.weight": rand(args.num_heads * hd, 2 * h),
        f"{mid}self_attn.k_proj.weight": rand(args.num_kv_heads * hd, 2 * h),
        f"{mid}self_attn.v_proj.weight": rand(args.num_kv_heads * hd, 2 * h),
        f"{mid}self_attn.o_proj.weight": rand(h, args.num_heads * hd),
        f"{mid}mlp.gate_proj.weight": rand(inter, h),
        f"{mid}mlp.up_proj.weight": rand(inter, h),
        f"{mid}mlp.down_proj.weight": rand(h, inter),
        "norm.weight": 1 + rand(h),
        "lm_head.weight": rand(draft_vocab, h),
        "d2t": d2t_of(used),
        "t2d": t2d,
    }
    save_file(tensors, str(directory / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (target / name).is_file():
            (directory / name).write_bytes((target / name).read_bytes())
    return directory
