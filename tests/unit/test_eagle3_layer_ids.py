"""The +1 trap: which target layers an EAGLE-3 head's config names, per published layout.

Each reference below is written from its authors' code, on `transformers`' hidden states: with
`output_hidden_states=True`, `hidden_states[i]` for i < L is the residual stream entering layer
i (index 0 the embeddings), i.e. the output of layer i - 1 — what SGLang and vLLM capture as
`hidden_states + residual` before running layer i. specpair's side is `LlamaModel.forward_aux`
with the layers `aux_layers` reads from a config.json of that layout; a negative control reads
the same ids under the other convention and must not match.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from specpair.models.eagle3_loading import KEY, aux_layers
from specpair.models.loading import CheckpointError, load_llama
from specpair.models.tiny import make_tiny_llama
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import BatchLayout

L, T = 8, 10  # L = 8: the default (entering 2, L//2, L - 3) is three distinct layers
TOKENS = torch.randint(0, 320, (1, T), generator=torch.Generator().manual_seed(0))

Entering = Sequence[torch.Tensor]  # entering[i]: the state entering layer i, [1, T, H]


def sglang(entering: Entering, ids: list[int] | None) -> torch.Tensor:
    """sgl-project/sglang python/sglang/srt/models/llama.py (00239548): set_eagle3_layers_to_capture
    (`[2, num_layers // 2, num_layers - 3]` without ids, else `[val + 1 for val in layer_ids]`),
    LlamaModel.forward (`if i in self.layers_to_capture: aux_hidden_states.append(hidden_states
    + residual)` before layer i), logits_processor.py `torch.cat(aux_pruned_states, dim=-1)`."""
    layers_to_capture = [2, L // 2, L - 3] if ids is None else [val + 1 for val in ids]
    return torch.cat([entering[i] for i in range(L) if i in layers_to_capture], -1)


def specforge_hf(hidden_states: Entering, ids: list[int]) -> torch.Tensor:
    """sgl-project/SpecForge specforge/modeling/target/eagle3_target_model.py (ac8e82ca),
    HFEagle3TargetModel: "output_hidden_states = True will return the embedding output as well
    so we have an offset of 1"; `outputs.hidden_states[aux_hidden_states_layers[k] + offset]`."""
    return torch.cat([hidden_states[i + 1] for i in ids], -1)


def safeailab(entering: Entering) -> torch.Tensor:
    """SafeAILab/EAGLE eagle/model/modeling_llama_kv.py (cb7e0841) LlamaModel.forward: `if
    idx==len(self.layers)-3 or idx==len(self.layers)//2 or idx==2: all_hidden_states +=
    (hidden_states,)` before layer idx; eagle/model/utils.py `torch.cat(outputs["hidden_states"],
    dim=-1)`. Its config carries no ids."""
    return torch.cat([entering[idx] for idx in range(L) if idx in (L - 3, L // 2, 2)], -1)


def vllm(entering: Entering, ids: list[int] | None) -> torch.Tensor:
    """vllm-project/vllm vllm/model_executor/models/llama.py (e06c9ba2) LlamaModel.forward: `if idx
    in self.aux_hidden_state_layers: aux_hidden_states.append(hidden_states + residual)` before
    layer idx; the ids are the draft config's top-level key as given
    (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py, da844450), else
    get_eagle3_aux_hidden_state_layers `(2, num_layers // 2, num_layers - 3)`."""
    aux_hidden_state_layers = (2, L // 2, L - 3) if ids is None else tuple(ids)
    return torch.cat([entering[idx] for idx in range(L) if idx in aux_hidden_state_layers], -1)


SPECULATORS = {
    "architectures": ["Eagle3Speculator"],
    "speculators_model_type": "eagle3",
    "speculators_config": {"algorithm": "eagle3"},
    "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1},
}
SPECFORGE = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("target"), seed=3, num_layers=L, tokenizer=False)


@pytest.fixture(scope="module")
def states(target: Path) -> tuple[torch.Tensor, ...]:
    """transformers' hidden_states [L + 1] x [1, T, H] on fixed tokens."""
    model = LlamaForCausalLM.from_pretrained(target).eval()
    with torch.no_grad():
        return model(TOKENS, output_hidden_states=True).hidden_states


@pytest.fixture(scope="module")
def ours(target: Path) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """specpair's features for `layers`: forward_aux's concatenated layer outputs."""
    model = load_llama(target)

    def features(layers: tuple[int, ...]) -> torch.Tensor:
        cache = KVCache.for_model(model.args, max_requests=1, max_len=T)
        layout = BatchLayout.causal([cache.alloc()], [0], [T])
        with torch.no_grad():
            _, aux = model.forward_aux(TOKENS, torch.arange(T)[None], cache.bind(layout), layers)
        return aux

    return features


def head(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)


# (layout, config.json, reference on (states, entering), outputs, the other convention's reading)
CASES: list[tuple[str, dict, Callable[[Entering, Entering], torch.Tensor], tuple, tuple]] = [
    (
        "SpecForge ids",
        {**SPECFORGE, "eagle_config": {KEY: [2, 4, 5], "use_aux_hidden_state": True}},
        lambda hs, entering: sglang(entering, [2, 4, 5]),
        (2, 4, 5),
        (1, 3, 4),  # vLLM's reading of the same ids
    ),
    (
        "SpecForge ids, SpecForge's HF capture",
        {**SPECFORGE, "eagle_config": {KEY: [1, 5, 6]}},
        lambda hs, entering: specforge_hf(hs, [1, 5, 6]),
        (1, 5, 6),
        (0, 4, 5),
    ),
    (
        "SGLang, no ids",
        SPECFORGE,
        lambda hs, entering: sglang(entering, None),
        (1, 3, 4),
        (2, 4, 5),  # SGLang's capture indices [2, L//2, L-3] read as layer outputs
    ),
    (
        "SafeAILab, no ids",
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "draft_vocab_size": 32},
        lambda hs, entering: safeailab(entering),
        (1, 3, 4),
        (2, 4, 5),
    ),
    (
        "speculators ids",
        {**SPECULATORS, KEY: [2, 4, 6]},
        lambda hs, entering: vllm(entering, [2, 4, 6]),
        (1, 3, 5),
        (2, 4, 6),  # SGLang's reading: the trap
    ),
    (
        "vLLM's architecture, top-level ids",
        {"architectures": ["Eagle3LlamaForCausalLM"], "model_type": "llama", KEY: [1, 5, 7]},
        lambda hs, entering: vllm(entering, [1, 5, 7]),
        (0, 4, 6),
        (1, 5, 7),
    ),
    (
        "speculators, no ids",
        SPECULATORS,
        lambda hs, entering: vllm(entering, None),
        (1, 3, 4),
        (2, 4, 5),
    ),
]


@pytest.mark.parametrize(
    ("config", "reference", "outputs", "other"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_features_match_the_authors(
    states: tuple[torch.Tensor, ...], ours, tmp_path: Path, config, reference, outputs, other
) -> None:
    expected = reference(states, states[:L])
    layers = aux_layers(head(tmp_path, config), L)
    assert layers == outputs
    assert close(ours(layers), expected)
    # Negative control: the off-by-one reading of the same config computes other features.
    assert other != layers and not close(ours(other), expected)


def test_the_issue_example_on_32_layers(tmp_path: Path) -> None:
    """[2, 16, 29] are outputs 2, 16, 29 for SpecForge but 1, 15, 28 for vLLM, whose default
    (SGLang's default capture too) is those same states entering layers 2, 16, 29."""
    ids = {KEY: [2, 16, 29]}
    assert aux_layers(head(tmp_path, {**SPECFORGE, "eagle_config": ids}), 32) == (2, 16, 29)
    assert aux_layers(head(tmp_path, {**SPECULATORS, **ids}), 32) == (1, 15, 28)
    assert aux_layers(head(tmp_path, SPECFORGE), 32) == (1, 15, 28)


def test_readings_that_agree_are_served(tmp_path: Path) -> None:
    both = {**SPECFORGE, "eagle_config": {KEY: [1, 3, 5]}, KEY: [2, 4, 6]}
    assert aux_layers(head(tmp_path, both), L) == (1, 3, 5)
    # SGLang ignores a top-level key and reads its default: the same states here.
    assert aux_layers(head(tmp_path, {**SPECFORGE, KEY: [2, 4, 5]}), L) == (1, 3, 4)
    # A plain LlamaForCausalLM (SafeAILab's name) names no runtime: vLLM alone reads the key.
    plain = {"architectures": ["LlamaForCausalLM"], KEY: [2, 4, 6]}
    assert aux_layers(head(tmp_path, plain), L) == (1, 3, 5)
    # vLLM's id L - 1 (entering the last layer) is the last output a later layer reads.
    assert aux_layers(head(tmp_path, {**SPECULATORS, KEY: [1, 3, 7]}), L) == (0, 2, 6)


@pytest.mark.parametrize(
    "config",
    [
        {**SPECFORGE, "eagle_config": {KEY: [2, 4, 5]}, KEY: [2, 4, 5]},  # one layer apart
        {**SPECFORGE, KEY: [2, 4, 6]},  # SGLang: its default (1, 3, 4); vLLM: (1, 3, 5)
        {**SPECULATORS, "eagle_config": {KEY: [2, 4, 6]}},  # vLLM ignores eagle_config
    ],
    ids=["both keys", "top-level key, SGLang's architecture", "eagle_config, speculators"],
)
def test_ambiguous_ids_are_refused(tmp_path: Path, config: dict) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json: ambiguous layer ids: .* Keep the"):
        aux_layers(head(tmp_path, config), L)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**SPECFORGE, "eagle_config": {KEY: [1, 3, 7]}}, r"7 is not a layer .*\(0 \.\. 6 for"),
        ({**SPECULATORS, KEY: [0, 3, 7]}, r"state entering layer i\).*0 is not .*\(1 \.\. 7 for"),
        ({**SPECULATORS, KEY: [1, 3, 8]}, r"8 is not a layer"),
        ({**SPECULATORS, KEY: [1, "3"]}, r"top level must be a list of ints"),
    ],
    ids=["SGLang: the last layer", "vLLM: the embeddings", "vLLM: past the end", "not ints"],
)
def test_ids_out_of_range_are_refused(tmp_path: Path, config: dict, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        aux_layers(head(tmp_path, config), L)
