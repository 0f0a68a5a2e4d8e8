"""Padded batches through deepseek_csa.transformers (issue 29) against transformers'
own eager DeepseekV4 with the same 2-D attention mask: left padding (generate()'s) and
right padding, position ids per row, prefill, chunked prefill, decode, greedy / beam /
sampling generate().  What eager does with pad tokens (docs/transformers.md, "Padded
batches") is what we reproduce: pad tokens are never keys of the sliding window, but they
are pooled into the compressed entries like any token (entries are formed by index), and
which entries a query sees follows its position id.

Tolerance: logits within 1e-5 of eager's largest |logit| (float32: the kernels and torch
sum in different orders, ~1e-7 relative per op over a 4-layer model), generate() tokens
identical.  No RuntimeWarning may be raised (no fallback)."""
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import deepseek_csa.transformers as dch  # noqa: E402
from test_transformers_bridge import make_model, ids_for, rel, LAYERS4  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: tiny models, one thread

LENGTHS = (37, 130, 301)


@pytest.fixture(scope="module")
def model():
    return make_model(seed=29, max_position_embeddings=1024)


def batch(lengths, left=True, seed=0):
    B, S = len(lengths), max(lengths)
    ids = ids_for(B, S, seed=seed)
    am = torch.zeros(B, S, dtype=torch.long)
    for b, n in enumerate(lengths):
        if left:
            am[b, S - n:] = 1
        else:
            am[b, :n] = 1
    ids = ids.masked_fill(am == 0, 0)            # the pad token id
    return ids, am


def gen_positions(am):
    """generate()'s position ids: real tokens count from 0, pad tokens get 1."""
    return (am.cumsum(-1) - 1).masked_fill(am == 0, 1)


def strict():
    w = warnings.catch_warnings()
    w.__enter__()
    warnings.simplefilter("error", RuntimeWarning)
    return w


def check(got, ref, am=None):
    assert rel(got, ref) < 1e-5, rel(got, ref)
    if am is not None:      # the real tokens' logits on their own scale
        m = am.bool()
        assert rel(got[m], ref[m]) < 1e-5


@pytest.mark.parametrize("left", [True, False], ids=["left", "right"])
@pytest.mark.parametrize("positions", ["generate", "default"])
def test_prefill(model, left, positions):
    ids, am = batch(LENGTHS, left=left, seed=1)
    kw = dict(attention_mask=am, use_cache=True)
    if positions == "generate":
        kw["position_ids"] = gen_positions(am)
    with torch.no_grad():
        ref = model(ids, **kw).logits
        w = strict()
        try:
            with dch.swapped(model):
                got = model(ids, **kw).logits
        finally:
            w.__exit__(None, None, None)
    check(got, ref, am)


def run_chunks(m, ids, am, cuts, swapped):
    out, cache = [], None
    ctx = dch.swapped(m) if swapped else None
    w = strict()
    try:
        if ctx is not None:
            ctx.__enter__()
        with torch.no_grad():
            for a, b in zip(cuts[:-1], cuts[1:]):
                pos = gen_positions(am[:, :b])[:, a:b]
                r = m(ids[:, a:b], attention_mask=am[:, :b], position_ids=pos,
                      past_key_values=cache, use_cache=True)
                cache = r.past_key_values
                out.append(r.logits)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
        w.__exit__(None, None, None)
    return out


def test_chunked_prefill_and_decode(model):
    ids, am = batch((37, 130, 301, 64), seed=2)
    gen = ids_for(4, 12, seed=3)
    ids = torch.cat([ids, gen], 1)
    am = torch.cat([am, torch.ones(4, 12, dtype=torch.long)], 1)
    S = 301
    cuts = [0, 100, 230, 231, S] + list(range(S + 1, S + 13))
    ref = run_chunks(model, ids, am, cuts, False)
    got = run_chunks(model, ids, am, cuts, True)
    for r, g in zip(ref, got):
        check(g, r)


def test_decode_after_padded_prefill(model):
    ids, am = batch(LENGTHS, seed=4)
    gen = ids_for(3, 16, seed=5)
    ids = torch.cat([ids, gen], 1)
    am = torch.cat([am, torch.ones(3, 16, dtype=torch.long)], 1)
    cuts = [0, 301] + list(range(302, 318))
    ref = run_chunks(model, ids, am, cuts, False)
    got = run_chunks(model, ids, am, cuts, True)
    for r, g in zip(ref, got):
        check(g, r)


def _generate(m, ids, am, swapped, **kw):
    with torch.no_grad():
        if not swapped:
            return m.generate(ids, attention_mask=am, **kw)
        w = strict()
        try:
            with dch.swapped(m):
                return m.generate(ids, attention_mask=am, **kw)
        finally:
            w.__exit__(None, None, None)


def test_generate_greedy_32(model):
    ids, am = batch((37, 130, 301, 90), seed=6)
    kw = dict(max_new_tokens=32, do_sample=False, pad_token_id=0)
    ref = _generate(model, ids, am, False, **kw)
    got = _generate(model, ids, am, True, **kw)
    assert torch.equal(ref, got)


def test_generate_beam(model):
    ids, am = batch((37, 80, 130), seed=7)
    kw = dict(max_new_tokens=10, num_beams=3, do_sample=False, early_stopping=False,
              pad_token_id=0)
    ref = _generate(model, ids, am, False, **kw)
    got = _generate(model, ids, am, True, **kw)
    assert torch.equal(ref, got)


def test_generate_sampling(model):
    ids, am = batch((37, 130, 60), seed=8)
    kw = dict(max_new_tokens=12, do_sample=True, top_k=20, pad_token_id=0)
    torch.manual_seed(0)
    ref = _generate(model, ids, am, False, **kw)
    torch.manual_seed(0)
    got = _generate(model, ids, am, True, **kw)
    assert torch.equal(ref, got)


def test_padded_dense_mask_not_built(model, monkeypatch):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl
    ids, am = batch((37, 130), seed=9)
    pos = gen_positions(am)
    with torch.no_grad():
        ref = model(ids, attention_mask=am, position_ids=pos).logits

    def boom(*a, **k):
        raise AssertionError("dense mask built")

    monkeypatch.setattr(mdl, "create_sliding_window_causal_mask", boom)
    with torch.no_grad(), dch.swapped(model):
        got = model(ids, attention_mask=am, position_ids=pos).logits
    check(got, ref, am)


def test_some_layers_swapped_padded(model):
    ids, am = batch((37, 130), seed=10)
    pos = gen_positions(am)
    with torch.no_grad():
        ref = model(ids, attention_mask=am, position_ids=pos).logits
        for layers in ([1], [2, 3], [0]):
            with dch.swapped(model, layers):
                got = model(ids, attention_mask=am, position_ids=pos).logits
            check(got, ref, am)
