"""deepseek_csa.torch: drop-in ops with the released call signatures (float32 without copies,
bfloat16 through float32) and layer-by-layer swaps on the reference model (deepseek_csa.reference.layer,
shaped like the released model.py)."""
import copy

import ml_dtypes
import numpy as np
import pytest
import torch

import deepseek_csa as dc
import ref_layer as R

import deepseek_csa.torch as dct


def small_args(ratios=(0, 4, 128, 4), **kw):
    base = dict(max_batch_size=2, max_seq_len=384, dim=256, n_heads=8, head_dim=128,
                rope_head_dim=64, q_lora_rank=64, o_lora_rank=32, o_groups=4, window_size=16,
                compress_ratios=tuple(ratios), index_n_heads=8, index_head_dim=64,
                index_topk=16)
    base.update(kw)
    return R.ModelArgs(**base)


def test_lazy_torch_import():
    import subprocess
    import sys
    code = ("import sys, deepseek_csa, deepseek_csa.layer; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sparse_attn_dropin(rng):
    q = torch.from_numpy(rng.standard_normal((2, 5, 4, 64), dtype=np.float32))
    kv = torch.from_numpy(rng.standard_normal((2, 11, 64), dtype=np.float32))
    sink = torch.from_numpy(rng.standard_normal(4, dtype=np.float32))
    idx = torch.from_numpy(rng.integers(-1, 11, (2, 5, 7)).astype(np.int32))
    want = R.sparse_attn(q, kv, sink, idx, 0.125)
    got = dct.sparse_attn(q, kv, sink, idx, 0.125)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got64 = dct.sparse_attn(q, kv, sink, idx.long(), 0.125)
    torch.testing.assert_close(got64, want, rtol=1e-5, atol=1e-6)
    qb, kvb = q.bfloat16(), kv.bfloat16()
    gb = dct.sparse_attn(qb, kvb, sink, idx, 0.125)
    assert gb.dtype == torch.bfloat16
    torch.testing.assert_close(gb.float(), R.sparse_attn(qb, kvb, sink, idx, 0.125).float(),
                               rtol=2e-2, atol=2e-2)
    # bf16 goes to the kernel as is: the same bits as calling it on the bf16 arrays
    direct = dc.sparse_attn(qb.float().numpy().astype(ml_dtypes.bfloat16),
                            kvb.float().numpy().astype(ml_dtypes.bfloat16), sink.numpy(),
                            idx.numpy(), 0.125)
    assert np.array_equal(gb.view(torch.int16).numpy().view(np.uint16), direct.view(np.uint16))


def test_rope_dropin_in_place_no_copy(rng):
    fc = R.precompute_freqs_cis(64, 32, 65536, 160000.0, 16, 32, 1)
    x = torch.from_numpy(rng.standard_normal((2, 32, 4, 128), dtype=np.float32))
    want = x.clone()
    R.apply_rotary_emb(want[..., -64:], fc)
    ptr = x.data_ptr()
    out = dct.apply_rotary_emb(x[..., -64:], fc)
    assert x.data_ptr() == ptr and out.data_ptr() == x[..., -64:].data_ptr()
    torch.testing.assert_close(x, want, rtol=1e-6, atol=1e-6)
    dct.apply_rotary_emb(x[..., -64:], fc, inverse=True)
    R.apply_rotary_emb(want[..., -64:], fc, True)
    torch.testing.assert_close(x, want, rtol=1e-6, atol=1e-6)
    xb = x.bfloat16()
    wb = xb.clone()
    dct.apply_rotary_emb(xb[:, :1, :, -64:], fc[5:6])
    R.apply_rotary_emb(wb[:, :1, :, -64:], fc[5:6])
    torch.testing.assert_close(xb.float(), wb.float(), rtol=1e-2, atol=1e-2)


def test_norm_qat_hadamard_dropins(rng):
    x = torch.from_numpy(rng.standard_normal((3, 7, 128), dtype=np.float32) * 3)
    mod = R.RMSNorm(128)
    with torch.no_grad():
        mod.weight.copy_(torch.rand(128) + 0.5)
        want = mod(x)
    torch.testing.assert_close(dct.rms_norm_forward(mod, x), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dct.rms_norm(x.bfloat16(), mod.weight).float(),
                               mod(x.bfloat16()).float(), rtol=1e-2, atol=1e-2)
    a, b = x.clone(), x.clone()
    dct.act_quant(a[..., :64], 64, "ue8m0", None, True)
    R.act_quant(b[..., :64], 64, "ue8m0", None, True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    a, b = x.clone(), x.clone()
    dct.fp4_act_quant(a, 32, True)
    R.fp4_act_quant(b, 32, True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(dct.rotate_activation(x), R.rotate_activation(x),
                               rtol=1e-5, atol=1e-5)
    # bf16 tensors: rounded in place / rotated by the kernels, the released way
    # (float32 inside, one rounding to bf16): the same bits as the reference's round trip
    xb = x.bfloat16()
    a, b = xb.clone(), xb.clone()
    ptr = a.data_ptr()
    dct.act_quant(a[..., :64], 64, "ue8m0", None, True)
    R.act_quant(b[..., :64], 64, "ue8m0", None, True)
    assert a.data_ptr() == ptr and torch.equal(a.view(torch.int16), b.view(torch.int16))
    a, b = xb.clone(), xb.clone()
    dct.fp4_act_quant(a, 32, True)
    R.fp4_act_quant(b, 32, True)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    hb = dct.rotate_activation(xb)
    assert hb.dtype == torch.bfloat16
    torch.testing.assert_close(hb.float(), R.rotate_activation(xb.float()).bfloat16().float(),
                               rtol=2 ** -8, atol=1e-6)
    saved = dict(dct._ORIG)
    dct._ORIG.clear()
    try:
        with pytest.raises(NotImplementedError):
            dct.act_quant(x, 64, "ue8m0", None, False)
    finally:
        dct._ORIG.update(saved)


def test_index_list_dropins():
    for p, s in [(0, 37), (5, 1), (40, 1)]:
        # order within a row is free (docs/kernels.md section 6); the kernel lists them as the released code
        np.testing.assert_array_equal(np.sort(dct.get_window_topk_idxs(16, 2, s, p).numpy()),
                                      np.sort(R.get_window_topk_idxs(16, 2, s, p).numpy()))
        np.testing.assert_array_equal(dct.get_compress_topk_idxs(4, 2, s, p, 9).numpy(),
                                      R.get_compress_topk_idxs(4, 2, s, p, 9).numpy())


def _stack(args, seed=3):
    return R.randomize(R.AttnStack(args), seed)


def _run(x, S, steps):
    def run(m):
        m(torch.from_numpy(x[:, :S]), 0)
        for p in range(S, S + steps):
            m(torch.from_numpy(x[:, p:p + 1]), p)
    return run


def test_swap_each_layer_matches_unswapped():
    """The issue's bar on the reference model: each swapped layer within 1e-4 relative of
    the unswapped float32 run, every layer's output and every top-k set identical."""
    args = small_args()
    base = _stack(args)
    x = np.random.default_rng(0).standard_normal((2, 97, args.dim), dtype=np.float32) * 0.3
    report = R.swap_report(lambda: copy.deepcopy(base), _run(x, 91, 6))
    assert [r["layer"] for r in report] == [0, 1, 2, 3]
    for r in report:
        assert r["ok"], r   # 1e-4 and identical top-k (unless a QAT rounding flipped)
        # the layers it does not swap see the same inputs, so they are unchanged
        assert all(e == 0 for l, e in r["per_layer"].items() if l != r["layer"]), r
    # swapped layers are really ours: a model with every layer swapped moves a little
    assert any(r["per_layer"][r["layer"]] > 0 for r in report)


def test_swap_subset_of_ops_and_unswap():
    args = small_args(ratios=(4, 128))
    base = _stack(args, 5)
    x = np.random.default_rng(1).standard_normal((1, 40, args.dim), dtype=np.float32) * 0.3
    rep = R.swap_report(lambda: copy.deepcopy(base), _run(x, 37, 3), ops=["sparse_attn"])
    assert all(r["ok"] for r in rep)
    m = copy.deepcopy(base)
    attn = m.layers[0]
    with dct.swap(m, layers=[0]) as sw:
        assert sw.layers == [0] and "forward" in attn.__dict__
        assert "forward" in attn.compressor.__dict__ and "forward" in attn.indexer.__dict__
        with pytest.raises(RuntimeError, match="already swapped"):
            dct.swap(m, layers=[0])
    assert "forward" not in attn.__dict__ and "forward" not in attn.compressor.__dict__
    dct.swap(attn)  # an Attention module by itself
    assert "forward" in attn.q_norm.__dict__
    dct.unswap(m)
    assert not any("forward" in mod.__dict__ for mod in m.modules())
    with pytest.raises(ValueError, match="no attention layer"):
        dct.swap(m, layers=[7])
    with pytest.raises(ValueError, match="unknown ops"):
        dct.swap(m, ops=["matmul"])


def test_swap_between_decode_steps():
    """The caches stay in the module's buffers: swapping mid-sequence continues it."""
    args = small_args(ratios=(4,))
    base = _stack(args, 9)
    x = np.random.default_rng(2).standard_normal((1, 30, args.dim), dtype=np.float32) * 0.3
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    with torch.no_grad():
        a(torch.from_numpy(x[:, :21]), 0)
        b(torch.from_numpy(x[:, :21]), 0)
        for p in range(21, 30):
            ya = a(torch.from_numpy(x[:, p:p + 1]), p)
            with dct.swap(b, layers=[0] if p % 2 else []):
                yb = b(torch.from_numpy(x[:, p:p + 1]), p)
            assert R.qat_close(yb.numpy(), ya.numpy())


V41_STACKS = {  # as tests/test_layer.py: the released order, and a ratio-2 candidate source
    "A": dict(compress_ratios=(0, 2, 2, 2, 1, 1, 1, 0), kv_source_layers=(1, 3, 4),
              index_source_layers=(1, 3, 4, 6), candidate_source_layer=4),
    "B": dict(compress_ratios=(0, 1, 1, 2, 2, 2, 0), kv_source_layers=(1, 3),
              index_source_layers=(1, 3, 5), candidate_source_layer=3)}


def _v41_model(name, seed=4):
    args = small_args(**V41_STACKS[name], index_n_heads=12, candidate_topk_blocks=6,
                      candidate_block_size=4)
    return args, R.randomize(R.AttnStack(args, v41=True), seed)


def _v41_run(x, S, steps):
    def run(m):
        R.reset_shared()
        _run(x, S, steps)(m)
    return run


@pytest.mark.parametrize("name", ["A", "B"])
@pytest.mark.parametrize("S,steps", [(41, 7), (3, 9)])
def test_swap_v41_model_equals_unswapped(name, S, steps):
    """``swap(model)`` with every op on a V4.1 model (the reference shaped like the released
    file, with its index-key republish quirk): every op routed where the layer has it,
    every layer's output within 1e-6 relative of the unswapped run and every top-k set
    identical.  Each layer gets the unswapped run's input (``record(substitute=...)``), so
    that a last-bit difference cannot flip a QAT rounding downstream; the shared state
    (compressed KV, index keys, top-k, candidate blocks) flows between swapped layers."""
    args, base = _v41_model(name)
    x = np.random.default_rng(4).standard_normal((2, S + steps, args.dim),
                                                 dtype=np.float32) * 0.3
    run = _v41_run(x, S, steps)
    b_out, b_tk = R.record(copy.deepcopy(base), run)
    m = copy.deepcopy(base)
    with dct.swap(m) as sw:
        outs, tks = R.record(m, run, substitute=b_out)
    for lid, a in enumerate(m.layers):
        got = set(sw.routed[lid])
        assert {"sparse_attn", "rope", "rms_norm", "qat", "index_lists"} <= got, (lid, got)
        assert ("compressor" in got) == a.is_kv_source if a.compress_ratio else True
        assert ("indexer" in got) == (a.indexer is not None), (lid, got)
        for g, w in zip(outs[lid], b_out[lid]):
            assert R.rel_err(g, w) <= 1e-6, (lid, R.rel_err(g, w))
    for lid in b_tk:
        assert len(tks[lid]) == len(b_tk[lid])
        for g, w in zip(tks[lid], b_tk[lid]):
            assert g.dtype == w.dtype == np.int32
            np.testing.assert_array_equal(np.sort(g, -1), np.sort(w, -1))


def test_swap_v41_each_layer_alone():
    """Each V4.1 layer swapped alone, the others left on torch: shared state published by
    a swapped layer (the candidate entry mask, index keys, compressed KV) is read by the
    unswapped torch layers after it and the other way round."""
    args, base = _v41_model("A", seed=5)
    x = np.random.default_rng(6).standard_normal((1, 40, args.dim), dtype=np.float32) * 0.3
    for r in R.swap_report(lambda: copy.deepcopy(base), _v41_run(x, 33, 7)):
        assert r["ok"] and r["topk_equal"], r
        assert all(e == 0 for l, e in r["per_layer"].items() if l != r["layer"]), r


def test_swap_v41_keeps_compress_kv_sharing():
    """A V4.1 reader (compress_ratio > 0, not a kv source) attends the cache its source
    published in shared_attn.compress_kv, with the source's compressor swapped."""
    args, base = _v41_model("A")
    m = copy.deepcopy(base)
    x = torch.from_numpy(np.random.default_rng(7).standard_normal((1, 21, args.dim),
                                                                  dtype=np.float32))
    seen = []
    h = m.layers[2].register_forward_pre_hook(lambda mod, a: seen.append(R.shared_attn.compress_kv))
    with torch.no_grad(), dct.swap(m, layers=[1], ops=["compressor"]):
        R.reset_shared()
        m(x, 0)
    h.remove()
    assert seen[0] is m.layers[1].compress_kv_cache
    assert m.layers[1].compress_kv_cache[0, :10].abs().sum() > 0


def test_fp4_act_quant_scale_dtype_dropin(rng):
    """V4.1 rounds its compressed KV with ``fp4_act_quant(x, 16, True,
    scale_dtype=torch.float8_e4m3fn)``: e4m3 scales, not powers of two."""
    x = torch.from_numpy(rng.standard_normal((2, 5, 128), dtype=np.float32) * 3)
    for dt in (torch.float32, torch.bfloat16):
        a, b = x.to(dt).clone(), x.to(dt).clone()
        dct.fp4_act_quant(a, 16, True, scale_dtype=torch.float8_e4m3fn)
        R.fp4_act_quant(b, 16, True, scale_dtype=torch.float8_e4m3fn)
        assert torch.equal(a, b), dt
        p2 = x.to(dt).clone()
        dct.fp4_act_quant(p2, 16, True)
        assert not torch.equal(a, p2)          # power-of-two scales round otherwise
    with pytest.raises(ValueError, match="scale_dtype"):
        dct.fp4_act_quant(x.clone(), 16, True, scale_dtype=torch.float16)


def test_swap_warns_when_an_op_stays_on_torch():
    """An indexer of an unknown shape (here a forward with another signature) stays on
    torch: swap says so, naming the module; nothing is left unsaid."""
    args, base = _v41_model("A")

    class OddIndexer(torch.nn.Module):
        def forward(self, x, start_pos):
            return None

    m = copy.deepcopy(base)
    m.layers[1].indexer = OddIndexer()
    with pytest.warns(UserWarning, match=r"layer 1: indexer \(OddIndexer\)"):
        sw = dct.swap(m)
    assert "indexer" not in sw.routed[1] and "indexer" in sw.routed[3]
    sw.undo()


def test_swap_bf16_model():
    """bfloat16 model (the released dtypes): a swapped layer within bf16 tolerance of the
    unswapped run and >= 99% of its top-k entries shared."""
    args = small_args(ratios=(4, 128, 0))
    base = R.to_bf16(_stack(args, 6))
    x = np.random.default_rng(3).standard_normal((1, 77, args.dim), dtype=np.float32) * 0.3
    xb = torch.from_numpy(x).bfloat16()

    def run(m):
        m(xb[:, :71], 0)
        for p in range(71, 77):
            m(xb[:, p:p + 1], p)
    b_out, b_tk = R.record(copy.deepcopy(base), run)
    for lid in (0, 1, 2):
        m = copy.deepcopy(base)
        with dct.swap(m, layers=[lid]):
            outs, tks = R.record(m, run, substitute={lid: b_out[lid]})
        for g, w in zip(outs[lid], b_out[lid]):
            assert R.rel_err(g, w) < 3e-2, lid
        for g, w in zip(tks[0], b_tk[0]):
            rows = zip(g.reshape(-1, g.shape[-1]), w.reshape(-1, w.shape[-1]))
            same = sum(len(set(a[a >= 0].tolist()) & set(b[b >= 0].tolist())) for a, b in rows)
            assert same >= 0.99 * (w >= 0).sum()


def test_swap_prefill_shorter_than_ratio():
    """Prefill of 3 tokens (no compressed entry yet, an empty top-k), then decode across
    the first groups."""
    args = small_args(ratios=(4, 16))
    base = _stack(args, 8)
    x = np.random.default_rng(5).standard_normal((2, 21, args.dim), dtype=np.float32) * 0.3
    for r in R.swap_report(lambda: copy.deepcopy(base), _run(x, 3, 18)):
        assert r["ok"], r
