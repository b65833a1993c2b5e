"""training/regen.py: the EAGLE-3 head's training stream is the target's own continuations;
training/train_eagle3.py goes on from a trained head on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from specpair.config import MODELS_DIR
from training.corpus import EOT, load_tokenizer
from training.regen import TEMPERATURES, prose_paragraphs, regenerate, samples
from training.train_eagle3 import train_eagle3

SOURCE = '''\
def area(r):
    """Return the area of a circle whose radius is the given number, measured in the same unit
    as the result's square root; a negative radius is taken as its absolute value, since a
    circle has no negative size and callers often pass differences of two coordinates.

    >>> area(1.0)
    3.14159
    """
    x = compute(r) if r else default_value_for_the_empty_case_with_a_long_name_here(r, r, r)
    y = another_call_with_arguments(x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x)
    return y


def short():
    """Too short."""
'''


def test_prose_paragraphs_are_docstring_prose_on_one_line_and_never_code() -> None:
    paragraphs = prose_paragraphs([SOURCE])
    assert len(paragraphs) == 1
    assert paragraphs[0].startswith("Return the area of a circle whose radius")
    assert paragraphs[0].endswith("differences of two coordinates.")
    assert "\n" not in paragraphs[0] and "  " not in paragraphs[0]
    # The doctest paragraph and the code after the closing quotes are not prose.
    assert not any(">>>" in p or "compute(" in p for p in paragraphs)


def test_samples_are_prompts_then_the_targets_own_continuation() -> None:
    target = LlamaForCausalLM.from_pretrained(str(MODELS_DIR / "target")).eval()
    tok = load_tokenizer(MODELS_DIR / "target")
    eot = tok.token_to_id(EOT)
    code = np.asarray(tok.encode(SOURCE * 40).ids)
    prose = [np.asarray(tok.encode(p).ids) for p in prose_paragraphs([SOURCE])]
    rng = np.random.default_rng(0)
    gen = samples(target, eot, code, prose, batch=2, new_tokens=6, rng=rng)
    batches = [next(gen) for _ in range(9)]
    # code, code, prose, ...: each kind turns over every temperature (prose greedy too)
    code_batches = [b for i, b in enumerate(batches) if i % 3 != 2]
    assert [b[0].temperature for b in code_batches] == [*TEMPERATURES, *TEMPERATURES]
    assert [b[0].temperature for b in batches[2::3]] == list(TEMPERATURES)
    greedy = batches[0]
    for sample in greedy:
        # A window of the code stream, then what greedy decoding of it gives.
        n = len(sample.prompt)
        assert 64 <= n <= 256
        assert any(np.array_equal(code[i : i + n], sample.prompt) for i in range(len(code) - n))
        ids = torch.from_numpy(sample.prompt)[None]
        ref = target.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=eot)[0]
        cont = ref[len(sample.prompt) :].numpy()
        cut = np.flatnonzero(cont == eot)
        assert sample.continuation.tolist() == cont[: cut[0] if len(cut) else None].tolist()
    for sample in [s for b in batches[2::3] for s in b]:  # prose: a paragraph's start
        assert sample.prompt.tolist() == prose[0][: len(sample.prompt)].tolist()
        assert eot not in sample.continuation


def test_regenerate_joins_samples_with_eot() -> None:
    target = LlamaForCausalLM.from_pretrained(str(MODELS_DIR / "target")).eval()
    tok = load_tokenizer(MODELS_DIR / "target")
    code = np.asarray(tok.encode(SOURCE * 40).ids, dtype=np.uint16)
    stream = regenerate(target, tok, code, [SOURCE], seconds=0.0, batch=3, new_tokens=5, seed=0)
    eot = tok.token_to_id(EOT)
    assert stream.dtype == np.uint16
    pieces = np.split(stream, np.flatnonzero(stream == eot) + 1)[:-1]
    assert len(pieces) == 3 and all(p[-1] == eot for p in pieces)
    # One batch ran (a zero budget still makes one): prompts of one length, <= 5 new tokens.
    assert all(len(p) <= len(pieces[0]) + 5 for p in pieces)


def test_train_eagle3_init_from_goes_on_from_the_given_head(tmp_path: Path) -> None:
    """`--init-from`: the head starts as the given one, draft vocabulary and all (a key that
    failed to load would leave it at its random init, far from the shipped weights)."""
    tok = load_tokenizer(MODELS_DIR / "target")
    ids = np.asarray(tok.encode(SOURCE * 20).ids, dtype=np.uint16)
    train_eagle3(
        MODELS_DIR / "target",
        ids,
        ids,
        tmp_path / "head",
        tmp_path,
        steps=1,
        seconds=None,
        batch=1,
        seq_len=32,
        ttt_steps=2,
        vocab=0,
        layers=[1, 2, 4],
        intermediate_size=1024,
        lr=1e-9,
        seed=0,
        init_from=MODELS_DIR / "eagle3",
    )
    shipped = load_file(str(MODELS_DIR / "eagle3" / "model.safetensors"))
    trained = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert shipped.keys() == trained.keys()
    assert torch.equal(shipped["d2t"], trained["d2t"]) and torch.equal(
        shipped["t2d"], trained["t2d"]
    )
    for name, w in shipped.items():
        if w.is_floating_point():  # one step at lr 1e-9: bf16 rounding apart
            torch.testing.assert_close(trained[name].float(), w.float(), rtol=1e-2, atol=1e-3)
