"""Load Hugging Face Llama-family checkpoints as published (config via `transformers`; weights
from safetensors or `pytorch_model*.bin`, sharded through their index or not)."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig

from specpair.models.args import ACTIVATIONS, ModelArgs
from specpair.models.draft_vocab import d2t_of
from specpair.models.eagle import EagleHead
from specpair.models.llama import LlamaModel
from specpair.models.rope import ROPE_TYPES, rope_inv_freq, rope_scale

EAGLE_ARCHITECTURE = "SpecpairEagleHead"
# SGLang's name for an EAGLE-3 head and vLLM's; SafeAILab's config says LlamaForCausalLM (its
# midlayer.* weights tell it). Which layer ids each means: eagle3_loading.py.
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# model_type -> the architecture it is served as; each is a Llama decoder (Qwen2 adds q/k/v
# biases, Mistral a sliding window that specpair refuses when it is shorter than the context).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served: missing files, wrong architecture, bad keys.

    The message starts with the file at fault and names the key, for a person to act on."""


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: unreadable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return data


def read_args(path: str | Path, *, allow_eagle: bool = False) -> ModelArgs:
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(
            f"{path}: no config.json (expected a Hugging Face checkpoint directory)"
        )
    raw = _read_json(file)
    archs = list(raw.get("architectures") or [])
    eagle = {EAGLE_ARCHITECTURE, *EAGLE3_ARCHITECTURES} if allow_eagle else set()
    allowed = set(ARCHITECTURES.values()) | eagle
    if raw.get("model_type") not in ARCHITECTURES or (archs and not set(archs) & allowed):
        raise CheckpointError(
            f"{file}: unsupported architecture {archs or raw.get('model_type')!r}; "
            f"specpair serves Llama-family checkpoints ({', '.join(sorted(allowed))})"
        )
    act = raw.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise CheckpointError(
            f"{file}: hidden_act {act!r} is not implemented (supported: {', '.join(ACTIVATIONS)})"
        )
    for key in ("rope_scaling", "rope_parameters"):
        rope = raw.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise CheckpointError(
                f"{file}: {key} type {kind!r} is not implemented (supported: "
                f"{', '.join(ROPE_TYPES)})"
            )
    try:
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        args = ModelArgs.from_hf(cfg)
        rope_inv_freq(args)  # a rope config lacking a key fails here, with the file named
        rope_scale(args)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CheckpointError(f"{file}: {type(exc).__name__}: {exc}") from None
    return args


def check_context(path: str | Path, args: ModelArgs, context: int) -> None:
    """Refuses a sliding window shorter than the served context: specpair attends to every
    earlier position, so past the window it would compute something the model never did."""
    if args.sliding_window is not None and args.sliding_window < context:
        raise CheckpointError(
            f"{Path(path) / 'config.json'}: sliding_window {args.sliding_window} is shorter than "
            f"the served context ({context} tokens: --max-len, on the target plus room for a "
            "draft tree); lower --max-len or use a checkpoint without a window"
        )


def eagle_layout(path: str | Path) -> str | None:
    """Which EAGLE head `path` holds: "specpair" (our own), "eagle3" (an EAGLE-3 head:
    `fc`, `midlayer.*`), "eagle" (SafeAILab's EAGLE-1/2 head as published: `fc` and
    `layers.0.*`, no `model.*` prefix, a Llama config) or None."""
    path = Path(path)
    archs = set(_read_json(path / "config.json").get("architectures") or [])
    if EAGLE_ARCHITECTURE in archs:
        return "specpair"
    names = weight_names(path)
    if archs & set(EAGLE3_ARCHITECTURES) or "midlayer.self_attn.q_proj.weight" in names:
        return "eagle3"
    if "fc.weight" in names and not any(n.startswith("model.") for n in names):
        return "eagle"
    return None


def is_eagle_checkpoint(path: str | Path) -> bool:
    return eagle_layout(path) is not None


def weight_files(path: Path) -> list[Path]:
    """The files holding a checkpoint's weights, in the order the Hub's tools look for them:
    a safetensors index (only the shards it lists), `*.safetensors` (but not Mistral's
    `consolidated.safetensors`, the same weights under other names), a `.bin` index, then
    `pytorch_model*.bin`."""
    for index, pattern in (
        ("model.safetensors.index.json", "*.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
    ):
        if (path / index).is_file():
            weight_map = _read_json(path / index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{path / index}: no weight_map")
            files = [path / name for name in sorted(set(weight_map.values()))]
            for file in files:
                if not file.is_file():
                    raise CheckpointError(f"{path / index}: lists {file.name}, which is missing")
            return files
        files = sorted(f for f in path.glob(pattern) if not f.name.startswith("consolidated"))
        if files:
            return files
    raise CheckpointError(
        f"{path}: no weights (model*.safetensors or pytorch_model*.bin"
        + (
            "; consolidated.* is Mistral's own layout, not served)"
            if any(path.glob("consolidated*"))
            else ")"
        )
    )


def weight_names(path: Path) -> set[str]:
    """The tensor names of a checkpoint, read from its index or file headers (cheap)."""
    files = weight_files(path)
    bin_files = files[0].suffix == ".bin"
    index = path / ("pytorch_model.bin.index.json" if bin_files else "model.safetensors.index.json")
    if index.is_file():  # weight_files checked its weight_map
        return set(_read_json(index)["weight_map"])
    if bin_files:
        return {name for file in files for name in _read_file(file, None)}
    names: set[str] = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                names.update(f.keys())
        except Exception as exc:
            raise CheckpointError(
                f"{file}: unreadable weights ({type(exc).__name__}: {exc})"
            ) from None
    return names


def _unreadable(file: Path, exc: Exception) -> CheckpointError:
    # a truncated or foreign file: name it, not a library's internals
    return CheckpointError(f"{file}: unreadable weights ({type(exc).__name__}: {exc})")


def _read_file(file: Path, wanted: set[str] | None) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".bin":  # a pickle: weights_only refuses anything but tensors
            state = torch.load(file, map_location="cpu", weights_only=True)
            if not isinstance(state, dict):
                raise CheckpointError(f"{file}: expected a dict of tensors")
            return {k: v for k, v in state.items() if wanted is None or k in wanted}
        with safe_open(str(file), framework="pt") as f:
            names = [n for n in f.keys() if wanted is None or n in wanted]  # noqa: SIM118
            return {name: f.get_tensor(name) for name in names}
    except CheckpointError:
        raise
    except Exception as exc:
        raise _unreadable(file, exc) from None


def read_tensors(path: Path, wanted: set[str] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, sharded or not (only `wanted` names if given)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        tensors.update(_read_file(file, wanted))
    return tensors


Index = tuple[slice, ...]  # () is the whole tensor; (slice(None), slice(0, 4)): its first columns
Read = Callable[[Index], torch.Tensor]  # reads that part of one tensor
Take = Callable[[str, torch.Size, Read], torch.Tensor]  # (name, full shape, read) -> kept part


class CheckpointTensors:
    """A checkpoint's tensors, read in part on demand. A safetensors file's `get_slice` reads
    only the bytes of the part asked for (the file is memory-mapped: pages another rank's
    process reads are shared through the page cache); pickled `.bin` files can only be read
    whole, at open. `shapes` comes from the file headers (or the loaded pickles)."""

    def __init__(self, path: Path) -> None:
        self.shapes: dict[str, torch.Size] = {}
        self._files: dict[str, tuple[Path, Any]] = {}  # name -> (file, its safe_open handle)
        self._whole: dict[str, torch.Tensor] = {}
        self._stack = ExitStack()
        for file in weight_files(path):
            if file.suffix == ".bin":
                self._whole.update(_read_file(file, None))
                continue
            try:
                f = self._stack.enter_context(safe_open(str(file), framework="pt"))
                for name in f.keys():  # noqa: SIM118
                    self.shapes[name] = torch.Size(f.get_slice(name).get_shape())
                    self._files[name] = (file, f)
            except Exception as exc:
                self._stack.close()
                raise _unreadable(file, exc) from None
        self.shapes.update({name: t.shape for name, t in self._whole.items()})

    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        if name in self._whole:  # a view would keep the whole pickled tensor alive
            return self._whole[name][index].clone() if index else self._whole[name]
        file, f = self._files[name]
        try:
            return f.get_slice(name)[index] if index else f.get_tensor(name)
        except Exception as exc:
            raise _unreadable(file, exc) from None

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stack.close()
        self._whole.clear()


def check_weights(
    path: Path, expected: Mapping[str, torch.Size], found: Mapping[str, torch.Size]
) -> None:
    """Refuses tensors (name -> shape) other than the architecture's, or of another shape."""
    missing, unexpected = set(expected) - set(found), set(found) - set(expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the architecture: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    for name, want in expected.items():
        if found[name] != want:
            raise CheckpointError(
                f"{path}: {name} has shape {tuple(found[name])}, config.json implies {tuple(want)}"
            )


def _load_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> None:
    expected = {name: t.shape for name, t in module.state_dict().items()}
    check_weights(path, expected, {name: t.shape for name, t in tensors.items()})
    module.load_state_dict(tensors, strict=True, assign=True)


def llama_args(path: Path, context: int | None) -> ModelArgs:
    """The config at `path`; `context` (tokens served) is checked against a sliding window."""
    args = read_args(path)
    check_context(path, args, context or args.max_position_embeddings)
    return args


def take_whole(name: str, shape: torch.Size, read: Read) -> torch.Tensor:
    return read(())


def read_llama(
    path: Path,
    args: ModelArgs,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    take: Take = take_whole,
) -> dict[str, torch.Tensor]:
    """Every tensor of a `LlamaModel` of `args` (HF names), each read, cast to `dtype` and moved
    to `device` before the next is read. Names and shapes are checked from the file headers
    before any weight is read. `take(name, full shape, read)` reads the part the caller keeps
    (a tensor-parallel rank's: `parallel.take_part`). A tied LM head is read from the embedding
    (HF stores it once; a stored copy is ignored, as `transformers` does)."""
    with torch.device("meta"):
        expected = {name: t.shape for name, t in LlamaModel(args).state_dict().items()}
    with CheckpointTensors(path) as checkpoint:
        source = {name: name for name in checkpoint.shapes}
        if args.tie_word_embeddings and "model.embed_tokens.weight" in source:
            source["lm_head.weight"] = "model.embed_tokens.weight"
        check_weights(path, expected, {n: checkpoint.shapes[s] for n, s in source.items()})
        tensors = {}
        for name, shape in expected.items():
            part = take(name, shape, functools.partial(checkpoint.read, source[name]))
            tensors[name] = part.to(dtype).to(device)
    return tensors


def load_llama(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    context: int | None = None,
) -> LlamaModel:
    """The model at `path`; `context` (tokens served) is checked against a sliding window."""
    path = Path(path)
    args = llama_args(path, context)
    with torch.device("meta"):
        model = LlamaModel(args)
    model.load_state_dict(read_llama(path, args, dtype=dtype, device=device), assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(args).to(device)
    return model.eval()


def load_eagle(
    path: str | Path,
    target_path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    context: int | None = None,
    token_map: torch.Tensor | None = None,
) -> EagleHead:
    """The EAGLE head at `path` (either layout of `eagle_layout`), with the LM head of the
    target at `target_path` (only its rows at `token_map`'s ids, ascending: what
    `token_map.load_token_map` reads) and its embedding unless the head brings its own."""
    path, target_path = Path(path), Path(target_path)
    args, target_args = read_args(path, allow_eagle=True), read_args(target_path)
    check_context(path, args, context or args.max_position_embeddings)
    layout = eagle_layout(path)
    if layout == "eagle3":
        raise CheckpointError(f"{path}: an EAGLE-3 head (eagle3_loading.load_eagle3 loads it)")
    if layout is None:
        raise CheckpointError(
            f"{path}: not an EAGLE head (neither architectures [{EAGLE_ARCHITECTURE!r}] in "
            "config.json nor the fc / layers.0 weights of a published EAGLE-1/2 head)"
        )
    public = layout == "eagle"
    # SafeAILab's ea_model.py: `bias = config["bias"]`, True where the key is absent.
    fc_bias = bool(_read_json(path / "config.json").get("bias", True)) if public else True
    try:
        with torch.device("meta"):
            head = EagleHead(
                args,
                target_args,
                fc_bias=fc_bias,
                input_norm=not public,
                draft_vocab_size=None if token_map is None else len(token_map),
            )
    except ValueError as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from None
    # Older heads saved the rotary buffer; the frequencies are recomputed from the config.
    tensors = {k: v for k, v in read_tensors(path).items() if not k.endswith("rotary_emb.inv_freq")}
    shared = read_tensors(target_path, {"model.embed_tokens.weight", "lm_head.weight"})
    # A published head may carry the embedding it was trained with; SafeAILab's code uses it.
    tensors.setdefault("embed_tokens.weight", shared["model.embed_tokens.weight"])
    tensors["lm_head.weight"] = shared.get("lm_head.weight", shared["model.embed_tokens.weight"])
    if token_map is not None:
        tensors["lm_head.weight"] = tensors["lm_head.weight"][token_map]
    tensors = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    if token_map is not None:  # an index map keeps its type
        tensors["d2t"] = d2t_of(token_map).to(device)
    _load_into(head, tensors, path)
    head.inv_freq = rope_inv_freq(args).to(device)
    return head.eval()


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's tokenizer (`AutoTokenizer`, local files only), None without one."""
    if not (Path(path) / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # a library's internals would not tell the user which file
        raise CheckpointError(
            f"{Path(path) / 'tokenizer.json'}: cannot load the tokenizer ({type(exc).__name__}: "
            f"{exc})"
        ) from None


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of a tokenizer's vocabulary (token → id); "" without a tokenizer. Two
    services agree on what every token id means exactly when their fingerprints match."""
    if tokenizer is None:
        return ""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]
