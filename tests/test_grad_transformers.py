"""Training through deepseek_csa.transformers: ``loss.backward()`` on a swapped
DeepseekV4ForCausalLM runs through deepseek_csa.torch's differentiable ops and equals
transformers' eager autograd; ``capture_indexer`` hands back the indexer's KL objective.

The swapped attention runs on the deepseek_csa operators (torch.ops.deepseek_csa, their
registered autograd formulas) in both modes of the ``ops`` fixture; the modes differ in
what serves ``deepseek_csa.torch.indexer_kl_loss`` for capture_indexer's records:
- ``real``: deepseek_csa.torch's own differentiable ops (docs/kernels.md section 11); skipped while
  this build lacks them (sparse_attn_weights / gated_pool / index_scores /
  indexer_kl_loss missing).
- ``standin``: the plain-torch stand-in tests/_grad_standin.py patched onto
  deepseek_csa.torch, so the KL objective's wiring is proven independently of the kernels.

Error budget: swapped and eager compute the same float32 function with sums in different
orders (the attention over gathered rows vs a dense masked softmax, pooling, norms):
~1e-6 relative per op.  The bar is issue 28's 1e-4 (norm-wise, per parameter) and 1e-4
on three SGD steps' losses.  A few parameters of the hyper-connections (``hc_head.*``,
``attn_hc.base``) have gradients that are tiny sums of cancelling terms (norm ~1e-5):
there eager float32 itself is up to ~1.1e-4 away from a float64 eager run, and one ulp of
change in the weights moves it ~1.8e-4 (measured), so a parameter's bar is max(1e-4, 2 x
its noise floor: eager float32's distance to float64, or that of an ulp-perturbed eager
run, the larger) -- the float64 and perturbed runs decide which parameters are at it.
"""
import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import deepseek_csa.transformers as dch  # noqa: E402

_supported = getattr(dch, "_supported", lambda v: v in dch.SUPPORTED_VERSIONS)
if not _supported(transformers.__version__):
    pytest.skip(f"deepseek_csa.transformers supports transformers {dch.SUPPORTED_VERSIONS}, "
                f"found {transformers.__version__}", allow_module_level=True)

from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl  # noqa: E402

import deepseek_csa.torch as dct  # noqa: E402

from _grad_standin import install, real_ops_available  # noqa: E402
from test_transformers_bridge import ids_for, make_model  # noqa: E402

TOL = 1e-4

# The forward's cache argument: 5.24 renamed it ``cache`` (``past_key_values`` stays an
# alias that warns, and the swapped run turns warnings into errors).
import inspect  # noqa: E402
CACHE_KW = ("cache" if "cache" in inspect.signature(mdl.DeepseekV4ForCausalLM.forward).parameters
            else "past_key_values")


# one thread each for torch and our kernels: tiny models (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(params=["standin", "real"])
def ops(request, monkeypatch):
    """Which differentiable ops deepseek_csa.torch serves: the stand-in or the real ones."""
    if request.param == "real":
        if not real_ops_available():
            pytest.skip("deepseek_csa.torch has no differentiable ops in this build yet "
                        "(the 'standin' mode of this test covers the training path)")
    else:
        install(monkeypatch)
    return request.param


def spy_ops(monkeypatch):
    """Counts the calls of each deepseek_csa operator (``deepseek_csa.torch.ops.call``,
    through which the swap calls every one)."""
    from collections import Counter
    from deepseek_csa.torch import ops as _ops
    calls = Counter()
    real = _ops.call

    def spy(name, *a):
        calls[name] += 1
        return real(name, *a)
    monkeypatch.setattr(_ops, "call", spy)
    return calls


def no_eager_attention(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("transformers' eager attention ran")
    monkeypatch.setattr(mdl, "eager_attention_forward", boom)


def grads(m):
    return {n: (None if p.grad is None else p.grad.detach().clone())
            for n, p in m.named_parameters()}


def lm_backward(m, ids, swapped, **kw):
    m.zero_grad(set_to_none=True)
    if swapped:
        with warnings.catch_warnings():
            warnings.simplefilter("error")            # no fallback, no warning
            with dch.swapped(m):
                out = m(ids, labels=ids, **kw)
                out.loss.backward()
    else:
        out = m(ids, labels=ids, **kw)
        out.loss.backward()
    return float(out.loss.detach()), grads(m)


def float64_noise(m, ids, **kw):
    """noise_floors of lm_backward."""
    return noise_floors(lambda model: lm_backward(model, ids, False, **kw)[1], m)


def noise_floors(grads_of, m):
    """Per parameter, the float32 noise floor of its gradient: the larger of eager float32's
    norm-wise distance to an eager float64 run of the same model and the distance of an
    eager float32 run whose weights moved by one ulp each (random signs) -- a float32
    function evaluated in another order is as far off as one evaluated on inputs an ulp
    away, so a gradient that cancels (hc_head.*, norm ~1e-5) shows its conditioning here
    even where one float32 order happened to land close to float64."""
    g32, g64 = grads_of(m), grads_of(float64_copy(m))
    mp = copy.deepcopy(m)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mp.parameters():
            p.mul_(1 + (torch.randint(0, 2, p.shape, generator=gen) * 2 - 1) * 2.0 ** -23)
    a, b = noise_floor(g32, g64), noise_floor(grads_of(mp), g64)
    return {n: max(a[n], b[n]) for n in a}


def float64_copy(m):
    m64 = copy.deepcopy(m).double()
    m64.config._experts_implementation = "eager"     # grouped_mm has no float64
    return m64


def noise_floor(g32, g64):
    """Per parameter, the norm-wise distance of float32 gradients g32 to float64 g64."""
    out = {}
    for n, b in g64.items():
        a = g32[n]
        if a is None or b is None or not b.any():
            out[n] = 0.0
        else:
            out[n] = float((a.double() - b).norm() / b.norm())
    return out


def assert_grads_close(got, ref, noise=None):
    assert got.keys() == ref.keys()
    bad = []
    for n in ref:
        a, b = got[n], ref[n]
        if b is None or a is None:
            if not ((a is None or not a.any()) and (b is None or not b.any())):
                bad.append((n, "one gradient missing"))
            continue
        nb = float(b.norm())
        err = float((a - b).norm()) / nb if nb else float(a.norm())
        tol = max(TOL, 2 * noise[n]) if noise else TOL
        if not err <= tol:
            bad.append((n, err, tol))
    assert not bad, bad


@pytest.mark.parametrize("checkpointed", [True, False])
def test_backward_matches_eager(ops, checkpointed, monkeypatch):
    """4 layers (sliding, CSA, HCA, CSA), batch 2, train mode: every parameter's gradient
    within 1e-4 (norm-wise) of eager's, and the swapped run never touches eager attention;
    with the attention segment recomputed in the backward (the default) or kept."""
    monkeypatch.setattr(dch, "CHECKPOINT_ATTENTION", checkpointed)
    m = make_model().train()
    ids = ids_for(2, 70, seed=21)
    le, ge = lm_backward(m, ids, False)
    calls = spy_ops(monkeypatch)
    no_eager_attention(monkeypatch)
    ls, gs = lm_backward(m, ids, True)
    assert abs(ls - le) <= TOL * abs(le)
    monkeypatch.undo()
    assert_grads_close(gs, ge, float64_noise(m, ids))
    # one call per layer, and one more in the backward when the segment is recomputed
    assert calls["sparse_attn"] == 4 * (2 if checkpointed else 1)
    assert calls["gated_pool"] >= 2
    # the CSA / HCA compressors and the sinks do get gradient through our ops
    for i in (1, 2, 3):
        a = m.model.layers[i].self_attn
        assert gs[f"model.layers.{i}.self_attn.compressor.kv_proj.weight"].abs().sum() > 0
        assert gs[f"model.layers.{i}.self_attn.compressor.position_bias"].abs().sum() > 0
        assert gs[f"model.layers.{i}.self_attn.sinks"].abs().sum() > 0, a
    # the indexer learns nothing from the LM loss (discrete selection), as in eager
    assert all(g is None for n, g in gs.items() if ".indexer." in n)


def test_backward_partial_swap(ops):
    """Layers 1 and 2 swapped, 0 and 3 eager (the dense mask is built for them)."""
    m = make_model(seed=5).train()
    ids = ids_for(2, 45, seed=28)
    le, ge = lm_backward(m, ids, False)
    m.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with dch.swapped(m, layers=[1, 2]):
            out = m(ids, labels=ids)
            out.loss.backward()
    assert abs(float(out.loss.detach()) - le) <= TOL * abs(le)
    assert_grads_close(grads(m), ge, float64_noise(m, ids))


def test_backward_with_cache_continuation(ops):
    """A prefill under no_grad into a cache, then a chunk with grad continuing it (the
    previous call's buffered tokens and overlap group feed this chunk's entries)."""
    m = make_model(seed=3).train()
    ids = ids_for(2, 66, seed=22)

    def run(swapped, model=m):
        ctx = dch.swapped(model) if swapped else _null()
        model.zero_grad(set_to_none=True)
        with ctx, warnings.catch_warnings():
            if swapped:
                warnings.simplefilter("error")
            with torch.no_grad():
                cache = model(ids[:, :37], use_cache=True).past_key_values
            out = model(ids[:, 37:], labels=ids[:, 37:], use_cache=True, **{CACHE_KW: cache})
            out.loss.backward()
        return float(out.loss.detach()), grads(model)

    le, ge = run(False)
    ls, gs = run(True)
    assert abs(ls - le) <= TOL * abs(le)
    # the hyper-connection parameters' noise floor, as in the tests above (AMD EPYC Zen 4:
    # hc_head.hc_base 1.8e-4 from eager float32, whose own one-ulp perturbation moves it 1.8e-4)
    assert_grads_close(gs, ge, noise_floors(lambda model: run(False, model)[1], m))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_three_sgd_steps(ops):
    """Three SGD steps from the same weights: the same losses (1e-4), eager vs swapped."""
    ids = ids_for(2, 64, seed=23)
    base = make_model(seed=1).train()
    runs = []
    for swapped in (False, True):
        m = copy.deepcopy(base)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        losses = []
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                if swapped:
                    warnings.simplefilter("error")
                ctx = dch.swapped(m) if swapped else _null()
                with ctx:
                    loss = m(ids, labels=ids).loss
                    loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        runs.append(losses)
    eager, ours = runs
    assert eager[2] < eager[0]                 # the steps do move the model
    for a, b in zip(ours, eager):
        assert abs(a - b) <= TOL * abs(b), (ours, eager)


def test_capture_kl_reaches_only_the_indexer(ops):
    m = make_model(seed=2).train()
    ids = ids_for(2, 70, seed=24)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with dch.swapped(m), dch.capture_indexer(m) as cap:
            out = m(ids, labels=ids)
    recs = cap.layers
    assert [r.layer for r in recs] == [1, 3]
    # the capture selects from the values the inference path would use: same logits
    with torch.no_grad(), dch.swapped(m):
        plain = m(ids).logits
    assert float((out.logits.detach() - plain).abs().max() / plain.abs().max()) < 1e-5
    for r in recs:
        ix = m.model.layers[r.layer].self_attn.compressor.indexer
        B, S, K = r.topk_idxs.shape
        assert (B, S, K) == (2, 70, ix.index_topk)
        assert r.q.shape == (2, 70, ix.num_heads, ix.head_dim)
        assert r.k.shape == (2, 70 // 4, ix.head_dim) and r.weights.shape == (2, 70, ix.num_heads)
        assert r.attn_target.shape == (2, 70, K) and not r.attn_target.requires_grad
        valid = r.topk_idxs >= 0
        assert bool((r.attn_target[~valid] == 0).all())
        assert bool((r.attn_target[valid] > 0).all())
        # summed over the 4 heads; the window and the sink take the rest
        assert float(r.attn_target.sum(-1).max()) <= 4 * (1 + 1e-5)
        pos = torch.arange(70)[None, :, None]
        assert bool((r.topk_idxs < (pos + 1) // 4).all())
    kl = cap.loss()
    by_hand = sum(dct.indexer_kl_loss(r.q, r.k, r.weights, r.topk_idxs, r.attn_target,
                                      ratio=r.ratio, start_pos=r.start_pos) for r in recs)
    assert torch.allclose(kl, by_hand)
    assert kl.dim() == 0 and float(kl.detach()) > 0
    m.zero_grad(set_to_none=True)
    kl.backward()
    got = {n for n, p in m.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert got and all(".compressor.indexer." in n for n in got), got
    assert any("indexer.q_b_proj" in n for n in got) and any("indexer.kv_proj" in n for n in got)
    assert any("weights_proj" in n for n in got)
    # and the LM loss reaches no indexer parameter, with the capture on
    m.zero_grad(set_to_none=True)
    out.loss.backward()
    assert all(p.grad is None for n, p in m.named_parameters() if ".indexer." in n)


def test_capture_frozen_model_and_dense(ops):
    """The notebook's setting: everything but the indexers frozen (the main path then
    runs on the inference kernels), dense warm-up target over every visible entry."""
    m = make_model(seed=4).train()
    for n, p in m.named_parameters():
        p.requires_grad_(".indexer." in n)
    ids = ids_for(2, 70, seed=25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with dch.capture_indexer(m, dense=True) as cap:
            m(ids)
    assert not dch.is_swapped(m)           # swapped for the block only
    for r in cap.layers:
        assert r.dense_target.shape == (2, 70, 70 // 4)
        vis = torch.arange(70 // 4)[None, :] < ((torch.arange(70) + 1) // 4)[:, None]
        assert bool((r.dense_target[:, ~vis] == 0).all())
        assert float(r.dense_target.sum(-1).max()) <= 4 * (1 + 1e-5)
    dense, sparse = cap.loss(), cap.loss(dense=False)
    assert float(dense.detach()) > 0 and float(sparse.detach()) >= 0
    dense.backward()
    assert all(p.grad is not None for n, p in m.named_parameters() if "indexer.q_b_proj" in n)


def test_fallback_only_without_the_ops(monkeypatch):
    """A build without the differentiable ops still falls back (one warning) and
    capture_indexer refuses with a clear error."""
    for n in ("gated_pool", "sparse_attn_weights", "index_scores", "indexer_kl_loss"):
        monkeypatch.delattr(dct, n, raising=False)
    m = make_model(layer_types=["compressed_sparse_attention"]).train()
    ids = ids_for(2, 30, seed=26)
    with dch.swapped(m):
        with pytest.warns(RuntimeWarning, match="no differentiable ops"):
            m(ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match="differentiable ops"):
        with dch.capture_indexer(m):
            pass


def test_qat_straight_through(ops):
    """qat=True in training: the roundings run forward, their gradient is the identity
    (straight-through): the backward completes, finite, near the unrounded one."""
    m = make_model(head_dim=72, partial_rotary_factor=8 / 72, index_head_dim=32).train()
    ids = ids_for(2, 60, seed=27)
    _, g0 = lm_backward(m, ids, True)
    m.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with dch.swapped(m, qat=True):
            m(ids, labels=ids).loss.backward()
    g1 = grads(m)
    for n, b in g0.items():
        a = g1[n]
        assert (a is None) == (b is None), n
        if b is not None and b.any() and ".self_attn." in n:
            assert torch.isfinite(a).all()
            assert float((a - b).norm() / b.norm()) < 0.5, n
    kv = g1["model.layers.1.self_attn.kv_proj.weight"]
    assert not torch.equal(kv, g0["model.layers.1.self_attn.kv_proj.weight"])


def padded_batch(B, S, lengths, left, seed):
    """ids [B, S] with row b's ``lengths[b]`` real tokens at its end (``left``) or start,
    pads set to 0, and the forward's keywords: the attention mask and, for left padding,
    per-row position ids counting from each row's first real token."""
    ids = ids_for(B, S, seed=seed)
    am = torch.zeros(B, S, dtype=torch.long)
    for b, n in enumerate(lengths):
        if left:
            am[b, S - n:] = 1
        else:
            am[b, :n] = 1
    ids = ids.masked_fill(am == 0, 0)
    kw = dict(attention_mask=am)
    if left:
        kw["position_ids"] = (am.cumsum(-1) - 1).masked_fill(am == 0, 1)
    return ids, kw


@pytest.mark.parametrize("left", [True, False], ids=["left", "right"])
def test_padded_batch_grads_match_eager(ops, left, monkeypatch):
    """A padded batch in training (2-D mask with zeros; left padding with generate()'s
    per-row position ids, right padding with the default ones): the swapped layers drop
    pad keys from the window, use per-row RoPE tables and per-row visibility, as the
    inference path; loss and every gradient within the same bar as the unpadded test,
    no fallback (lm_backward turns warnings into errors), eager attention never runs."""
    m = make_model(seed=31).train()
    B, S, lengths = 3, 70, (70, 45, 23)
    ids, kw = padded_batch(B, S, lengths, left, seed=32)
    le, ge = lm_backward(m, ids, False, **kw)
    no_eager_attention(monkeypatch)
    ls, gs = lm_backward(m, ids, True, **kw)
    assert abs(ls - le) <= TOL * abs(le)
    monkeypatch.undo()
    assert_grads_close(gs, ge, float64_noise(m, ids, **kw))


def _row_loss(rec, b, dense=False, target="selected"):
    """Row b's terms of a record's KL loss: the record cut to that row."""
    tgt = rec.dense_target if dense else rec.attn_target
    if target == "joint":
        tgt = tgt / rec.n_heads
    pos = None if rec.positions is None else rec.positions[b:b + 1]
    return dct.indexer_kl_loss(rec.q[b:b + 1], rec.k[b:b + 1], rec.weights[b:b + 1],
                               None if dense else rec.topk_idxs[b:b + 1], tgt[b:b + 1],
                               ratio=rec.ratio, start_pos=rec.start_pos, positions=pos,
                               target=target)


def _indexer_grads(m, loss):
    m.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)        # the records serve several losses
    return {n: p.grad.detach().clone() for n, p in m.named_parameters()
            if ".indexer." in n and p.grad is not None}


@pytest.mark.parametrize("left", [True, False], ids=["left", "right"])
def test_capture_padded_batch_rows_equal_rows_alone(ops, left):
    """capture_indexer on a padded batch (2-D mask with zeros; left padding with
    generate()'s per-row positions, right padding with the default ones) runs swapped,
    no fallback; pad queries take no part, and each row's KL terms (sparse and dense)
    and their gradients to the indexer equal that row run alone: unpadded for right
    padding, and for left padding the row with its own padding (eager pools pad tokens
    into the compressed entries by index, so a left-padded row is not the unpadded
    one: docs/transformers.md)."""
    m = make_model(layer_types=["compressed_sparse_attention"] * 2, seed=41).train()
    for n, p in m.named_parameters():
        p.requires_grad_(".indexer." in n)
    B, S, lengths = 3, 44, (44, 31, 17)
    ids, kw = padded_batch(B, S, lengths, left, seed=42)
    am = kw["attention_mask"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no fallback
        with dch.capture_indexer(m, dense=True) as cap:
            m(ids, **kw)
    recs = cap.layers
    assert [r.layer for r in recs] == [0, 1]
    for r in recs:
        real = am.bool()
        assert bool((r.topk_idxs[~real] == -1).all()) and bool((r.attn_target[~real] == 0).all())
        assert bool((r.dense_target[~real] == 0).all())
        assert (r.positions is not None) == left
    for b, n in enumerate(lengths):
        if left:
            one = dict(attention_mask=am[b:b + 1], position_ids=kw["position_ids"][b:b + 1])
            ids_b = ids[b:b + 1]
        else:
            one, ids_b = {}, ids[b:b + 1, :n]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with dch.capture_indexer(m, dense=True) as alone:
                m(ids_b, **one)
        for dense in (False, True):
            for target in ("selected", "joint"):
                got = sum(_row_loss(r, b, dense, target) for r in recs)
                want = sum(_row_loss(r, 0, dense, target) for r in alone.layers)
                if b == 0 or target == "selected":
                    want_total = alone.loss(dense) if target == "selected" else want
                    assert torch.allclose(want, want_total)
                g, w_ = got.item(), want.item()
                assert abs(g - w_) <= 1e-5 * abs(w_) + 1e-7, (b, dense, target, g, w_)
                gg, gw = _indexer_grads(m, got), _indexer_grads(m, want)
                assert gg.keys() == gw.keys() and gg
                for name in gw:
                    err = float((gg[name] - gw[name]).norm())
                    assert err <= 1e-4 * float(gw[name].norm()) + 1e-9, (name, b, dense)


def test_capture_target_and_clip_pass_through(ops):
    """capture_indexer(target="joint", clip=...): every record's loss is
    indexer_kl_loss on the recorded head sums over n_heads with that target and clip;
    the default is the selected target, unchanged."""
    m = make_model(seed=2).train()
    ids = ids_for(2, 70, seed=24)
    with torch.no_grad(), dch.capture_indexer(m, dense=True) as cap0:
        m(ids)
    with dch.capture_indexer(m, dense=True, target="joint", clip=-3.0) as cap:
        m(ids)
    for dense in (False, True):
        by_hand = sum(dct.indexer_kl_loss(
            r.q, r.k, r.weights, None if dense else r.topk_idxs,
            (r.dense_target if dense else r.attn_target) / r.n_heads, ratio=r.ratio,
            start_pos=r.start_pos, target="joint", clip=-3.0) for r in cap.layers)
        assert torch.allclose(cap.loss(dense), by_hand)
        sel = sum(dct.indexer_kl_loss(r.q, r.k, r.weights, None if dense else r.topk_idxs,
                                      r.dense_target if dense else r.attn_target,
                                      ratio=r.ratio, start_pos=r.start_pos)
                  for r in cap0.layers)
        assert torch.equal(cap0.loss(dense), sel)
        assert cap.loss(dense).item() < sel.item()     # weighted by masses < 1
    assert all(r.n_heads == 4 and r.positions is None for r in cap.layers)
    if ops == "real":                  # the metrics come from the kernel
        ms = cap.metrics()
        assert len(ms) == len(cap.layers)
        for m_, r in zip(ms, cap.layers):
            assert torch.allclose(m_.kl.float(), r.loss(True).detach())
            assert 0 < int(m_.rows) <= 2 * 70 and float(m_.kl_uniform) > 0
    with pytest.raises(ValueError, match="'target'"):
        with dch.capture_indexer(m, target="dense"):
            pass
    assert not dch.is_swapped(m)
