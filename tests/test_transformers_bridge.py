"""deepseek_csa.transformers against transformers' own DeepseekV4 (eager) on tiny random
models: logits of prefill, decode, chunked prefill, generate() (greedy and beam), each
layer swapped alone, up to top-k ties where exact-zero scores tie, the fallbacks."""
import contextlib
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import deepseek_csa.transformers as _dch  # noqa: E402

if not _dch._supported(transformers.__version__):
    pytest.skip(f"deepseek_csa.transformers supports transformers "
                f"{_dch.SUPPORTED_VERSIONS}, found {transformers.__version__}",
                allow_module_level=True)

from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl  # noqa: E402

import deepseek_csa as dc  # noqa: E402
import deepseek_csa.transformers as dch  # noqa: E402

LAYERS4 = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
           "compressed_sparse_attention"]


def make_model(layer_types=LAYERS4, index_n_heads=12, index_topk=5, hca_ratio=8, window=16,
               seed=0, **over):
    """A tiny random DeepseekV4ForCausalLM; position_bias and sinks randomized (the
    model initializes them to zero, which would hide their handling)."""
    n = len(layer_types)
    kw = dict(vocab_size=97, hidden_size=64, num_hidden_layers=n, num_attention_heads=4,
              head_dim=32, partial_rotary_factor=8 / 32, q_lora_rank=32, o_groups=2,
              o_lora_rank=16, moe_intermediate_size=32, n_routed_experts=4,
              num_experts_per_tok=2, n_shared_experts=1, layer_types=list(layer_types),
              mlp_layer_types=["moe"] * n,
              compress_rates={"compressed_sparse_attention": 4,
                              "heavily_compressed_attention": hca_ratio},
              sliding_window=window, hc_mult=2, hc_sinkhorn_iters=3,
              index_n_heads=index_n_heads, index_head_dim=16, index_topk=index_topk,
              num_nextn_predict_layers=0, max_position_embeddings=512)
    kw.update(over)
    cfg = DeepseekV4Config(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = DeepseekV4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("position_bias") or name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m


# one thread each for torch and our kernels: tiny models (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def model4():
    return make_model()


def ids_for(B, S, seed=0, vocab=97):
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


def run_steps(m, chunks, swapped, layers=None):
    """Feeds the token chunks through one cache; returns the logits of every call."""
    out = []
    cache = None
    ctx = dch.swapped(m, layers) if swapped else _null()
    with torch.no_grad(), ctx:
        for c in chunks:
            r = m(c, past_key_values=cache, use_cache=True)
            cache = r.past_key_values
            out.append(r.logits)
    return out, cache


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_selection_matters(model4):
    ix = model4.model.layers[1].self_attn.compressor.indexer
    assert ix.index_topk < 70 // 4


def test_prefill_no_cache_and_cache(model4):
    ids = ids_for(2, 70)
    with torch.no_grad():
        ref = model4(ids, use_cache=False).logits
        with dch.swapped(model4):
            a = model4(ids, use_cache=False).logits
            b = model4(ids, use_cache=True).logits
    assert rel(a, ref) < 1e-5 and rel(b, ref) < 1e-5
    assert not dch.is_swapped(model4)


def test_decode_steps(model4):
    ids = ids_for(2, 61, seed=1)
    chunks = [ids[:, :45]] + [ids[:, i:i + 1] for i in range(45, 61)]
    ref, _ = run_steps(model4, chunks, False)
    got, cache = run_steps(model4, chunks, True)
    for r, g in zip(ref, got):
        assert rel(g, r) < 1e-5
    assert isinstance(cache.layers[1], dch.CSACacheLayer)
    assert isinstance(cache.layers[2], dch.HCACacheLayer)


def test_chunked_prefill(model4):
    ids = ids_for(2, 90, seed=2)
    chunks = [ids[:, :37], ids[:, 37:66], ids[:, 66:67], ids[:, 67:90]]
    ref, _ = run_steps(model4, chunks, False)
    got, _ = run_steps(model4, chunks, True)
    for r, g in zip(ref, got):
        assert rel(g, r) < 1e-5
    with torch.no_grad():
        whole = model4(ids, use_cache=False).logits
    assert rel(got[-1], whole[:, 67:]) < 1e-5


def test_generate_greedy_40(model4):
    ids = ids_for(2, 50, seed=3)
    with torch.no_grad():
        ref = model4.generate(ids, max_new_tokens=40, do_sample=False)
        with dch.swapped(model4):
            got = model4.generate(ids, max_new_tokens=40, do_sample=False)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("layer", range(4))
def test_each_layer_alone(model4, layer):
    ids = ids_for(2, 53, seed=4 + layer)
    chunks = [ids[:, :40], ids[:, 40:41], ids[:, 41:53]]
    ref, _ = run_steps(model4, chunks, False)
    got, _ = run_steps(model4, chunks, True, layers=[layer])
    for r, g in zip(ref, got):
        assert rel(g, r) < 1e-5


def test_unweighted_norm_eps():
    """The unweighted norms' epsilon (``eps`` up to 5.24, ``variance_epsilon`` from 5.25)
    is read from the module: a large one on q_b_norm and the hyper-connections' norms
    changes the logits by far more than the bar (a fixed 1e-6 instead: 0.35 relative)."""
    m = make_model(seed=2)
    for mod in m.modules():
        if type(mod).__name__ == "DeepseekV4UnweightedRMSNorm":
            setattr(mod, "variance_epsilon" if hasattr(mod, "variance_epsilon") else "eps", 0.5)
    ids = ids_for(2, 40, seed=12)
    with torch.no_grad():
        ref = m(ids).logits
        with dch.swapped(m):
            got = m(ids).logits
    assert rel(got, ref) < 1e-5


def test_beam_search(model4):
    ids = ids_for(2, 40, seed=9)
    kw = dict(max_new_tokens=12, num_beams=3, do_sample=False, early_stopping=False)
    with torch.no_grad():
        ref = model4.generate(ids, **kw)
        with dch.swapped(model4):
            got = model4.generate(ids, **kw)
    assert torch.equal(ref, got)


def test_unswap_midway_shares_the_cache(model4):
    """A layer unswapped between calls continues from our state in transformers' code."""
    ids = ids_for(2, 70, seed=10)
    chunks = [ids[:, :41], ids[:, 41:42], ids[:, 42:60], ids[:, 60:70]]
    ref, _ = run_steps(model4, chunks, False)
    cache, out = None, []
    with torch.no_grad():
        for i, c in enumerate(chunks):
            if i % 2 == 0:
                dch.swap(model4)
            r = model4(c, past_key_values=cache, use_cache=True)
            dch.unswap(model4)
            cache = r.past_key_values
            out.append(r.logits)
    for r, g in zip(ref, out):
        assert rel(g, r) < 1e-5


def test_crop_and_reset(model4):
    ids = ids_for(2, 80, seed=11)
    ref, _ = run_steps(model4, [ids[:, :50], ids[:, 50:57], ids[:, 57:70]], False)
    with torch.no_grad(), dch.swapped(model4):
        r = model4(ids[:, :50], use_cache=True)
        cache = r.past_key_values
        for layer in cache.layers:
            layer.activate_past_recording() if hasattr(layer, "activate_past_recording") \
                else None
        model4(ids[:, 50:57], past_key_values=cache, use_cache=True)
        wrong = ids[:, 57:66].flip(0)
        model4(wrong, past_key_values=cache, use_cache=True)        # 9 tokens to drop
        cache.crop(-9)
        assert cache.get_seq_length() == 57
        got = model4(ids[:, 57:70], past_key_values=cache, use_cache=True).logits
        assert rel(got, ref[2]) < 1e-5
        cache.reset()
        assert cache.get_seq_length() == 0
        again = model4(ids[:, :50], past_key_values=cache, use_cache=True).logits
        assert rel(again, ref[0]) < 1e-5
    # without recording, a crop past the window is refused, not silently wrong
    with torch.no_grad(), dch.swapped(model4):
        cache = model4(ids[:, :50], use_cache=True).past_key_values
        with pytest.raises(RuntimeError):
            cache.layers[1].crop(-20)


def _capture_selection(monkeypatch):
    """Records every index_topk call's selection (compressed positions, -1 kept)."""
    got = []
    real = dc.index_topk

    def spy(q, k, w, topk, *, ratio, start_pos, offset=0, **kw):
        r = real(q, k, w, topk, ratio=ratio, start_pos=start_pos, offset=offset, **kw)
        got.append(np.where(r >= 0, r - offset, -1))
        return r

    monkeypatch.setattr(dc, "index_topk", spy)
    return got


def _check_up_to_ties(m, chunks, monkeypatch):
    """Feeds the chunks through one cache, swapped, recording our selections; then
    transformers' forward over the same chunks with our selections forced in, recording
    its own scores and torch.topk selections (so every later layer and call sees the
    same inputs).  The logits must agree and our selection must rank exactly as
    torch.topk's up to equal scores.  Returns the number of rows whose sets differ."""
    if not isinstance(chunks, (list, tuple)):
        chunks = [chunks]
    sels = _capture_selection(monkeypatch)
    ours, _ = run_steps(m, chunks, True)
    csa = [l.self_attn.compressor.indexer for l in m.model.layers
           if l.self_attn.layer_type == "compressed_sparse_attention"]
    assert len(sels) == len(csa) * len(chunks)
    queues = {id(ix): [torch.from_numpy(s).long() for s in sels[i::len(csa)]]
              for i, ix in enumerate(csa)}
    scores = {id(ix): [] for ix in csa}
    refs = {id(ix): [] for ix in csa}
    handles = []
    for ix in csa:
        def sc_hook(mod, inp, out, ix=ix):
            scores[id(ix)].append(out.detach().clone())

        def ix_hook(mod, inp, out, ix=ix):
            refs[id(ix)].append(out.detach().clone())
            return queues[id(ix)].pop(0)
        handles += [ix.scorer.register_forward_hook(sc_hook), ix.register_forward_hook(ix_hook)]
    try:
        forced, _ = run_steps(m, chunks, False)
    finally:
        for h in handles:
            h.remove()
    for a, b in zip(ours, forced):
        assert rel(a, b) < 1e-5
    ties = 0
    for i, ix in enumerate(csa):
        start = 0
        for c, sc, ref, sel in zip(chunks, scores[id(ix)], refs[id(ix)], sels[i::len(csa)]):
            S, T = c.shape[1], sc.shape[-1]
            P = start + torch.arange(S)
            start += S
            vis = torch.arange(T)[None, :] < ((P + 1) // ix.compress_rate)[:, None]
            sc = sc.masked_fill(~vis, float("-inf"))
            sel = torch.from_numpy(sel).long()
            assert sel.shape == ref.shape
            inf = torch.tensor(-np.inf)
            va = torch.where(sel >= 0, sc.gather(-1, sel.clamp(min=0)), inf).sort(-1).values
            vb = torch.where(ref >= 0, sc.gather(-1, ref.clamp(min=0)), inf).sort(-1).values
            fin = torch.isfinite(vb)
            assert torch.equal(torch.isfinite(va), fin)
            # the same scores are selected (equal up to ties, to rounding of the sums)
            assert torch.allclose(va[fin], vb[fin], rtol=1e-5, atol=1e-6)
            ties += int((sel.sort(-1).values != ref.where(ref >= 0, -1).sort(-1).values)
                        .any(-1).sum())
    return ties


def test_many_zero_scores_up_to_ties(monkeypatch):
    m = make_model(index_n_heads=1, index_topk=6, seed=5)
    ties = _check_up_to_ties(m, ids_for(2, 80, seed=12), monkeypatch)
    assert ties > 0      # the config does reach ties, so the check means something


def hf_tester_model(seed=0):
    """transformers' DeepseekV4ModelTester sizes (HCA + CSA, ratios 4 / 128)."""
    return make_model(layer_types=["heavily_compressed_attention",
                                   "compressed_sparse_attention"],
                      index_n_heads=2, index_topk=2, window=8, hca_ratio=128,
                      max_position_embeddings=64, moe_intermediate_size=64, seed=seed)


@pytest.mark.parametrize("S", [260, 300])
def test_transformers_tester_config(S, monkeypatch):
    """Prefill to S - 6 tokens (HCA entries at ratio 128 and CSA selection with
    index_topk = 2 both active), then decode steps, compared up to ties (2 index heads:
    exact-zero scores tie often)."""
    m = hf_tester_model()
    ids = ids_for(1, S, seed=S)
    _check_up_to_ties(m, ids, monkeypatch)
    chunks = [ids[:, :S - 6]] + [ids[:, i:i + 1] for i in range(S - 6, S)]
    _check_up_to_ties(m, chunks, monkeypatch)


def test_decode_and_chunks_up_to_ties(monkeypatch):
    m = make_model(index_n_heads=1, index_topk=6, seed=6)
    ids = ids_for(2, 70, seed=16)
    chunks = [ids[:, :33], ids[:, 33:34], ids[:, 34:51], ids[:, 51:52], ids[:, 52:70]]
    assert _check_up_to_ties(m, chunks, monkeypatch) > 0


def test_fallbacks_warn_and_match(model4):
    ids = ids_for(2, 40, seed=13)
    am = torch.ones(2, 40, dtype=torch.long)
    am[1, :3] = 0
    with torch.no_grad():
        ref = model4(ids, attention_mask=am).logits
    mask4 = torch.zeros(2, 1, 40, 40).masked_fill(
        torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    with torch.no_grad():
        ref = model4(ids, attention_mask={"sliding_attention": mask4}).logits
    with torch.no_grad(), dch.swapped(model4):
        with pytest.warns(RuntimeWarning, match="prebuilt"):
            got = model4(ids, attention_mask={"sliding_attention": mask4}).logits
        assert torch.equal(got, ref)
        with pytest.warns(RuntimeWarning, match="2-D attention mask of shape"):
            model4(ids, attention_mask=am[:, 1:])       # not past + S long
    with dch.swapped(model4):
        if dch._missing_grad_ops():
            with pytest.warns(RuntimeWarning, match="autograd"):
                model4(ids)                   # grad enabled, no differentiable ops yet
        # (with them, grad enabled stays swapped: tests/test_grad_transformers.py)
        with torch.no_grad(), pytest.warns(RuntimeWarning, match="output_attentions"):
            model4(ids, output_attentions=True)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")
            model4(ids)                       # the supported path warns nothing


def test_dense_mask_not_built(model4, monkeypatch):
    ids = ids_for(2, 30, seed=14)
    with torch.no_grad():
        ref = model4(ids).logits

    def boom(*a, **k):
        raise AssertionError("dense mask built")
    monkeypatch.setattr(mdl, "create_sliding_window_causal_mask", boom)
    with torch.no_grad(), dch.swapped(model4):
        got = model4(ids).logits
        with pytest.raises(AssertionError):
            with dch.swapped(model4, layers=[0, 1]):   # a partial swap needs the mask
                model4(ids)
    assert rel(got, ref) < 1e-5


def test_unswap_and_registry_untouched(model4):
    from transformers import cache_utils
    before = dict(cache_utils.DYNAMIC_LAYER_TYPE_MAPPING)
    dch.swap(model4, layers=[1, 2])
    assert "forward" in model4.model.layers[1].self_attn.__dict__
    dch.unswap(model4)
    assert all("forward" not in l.self_attn.__dict__ for l in model4.model.layers)
    assert "forward" not in model4.model.__dict__
    assert cache_utils.DYNAMIC_LAYER_TYPE_MAPPING == before
    with pytest.raises(TypeError):
        dch.swap(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError):
        dch.swap(model4, layers=[7])


def test_refuses_other_versions(monkeypatch):
    import sys
    m = make_model(layer_types=["sliding_attention"])
    for bad in ("5.22.0", "5.26.0", "5.25.0rc1", "6.0.0"):
        monkeypatch.setattr(sys.modules["transformers"], "__version__", bad)
        with pytest.raises(RuntimeError, match=r"found %s.*transformers==%s" % (
                bad.replace(".", r"\."), dch.SUPPORTED_VERSIONS[-1].replace(".", r"\."))):
            dch.swap(m)
    for ok in dch.SUPPORTED_VERSIONS + ("5.23.7", "5.24.3", "5.25.1"):
        monkeypatch.setattr(sys.modules["transformers"], "__version__", ok)
        dch.unswap(dch.swap(m))


def test_bf16_close_to_float32():
    m = make_model(seed=7)
    ids = ids_for(2, 60, seed=15)
    with torch.no_grad():
        ref32 = m(ids).logits
        mb = m.to(torch.bfloat16)
        eager16 = mb(ids).logits.float()
        with dch.swapped(mb):
            ours16 = mb(ids).logits.float()
    e_hf, e_ours = rel(eager16, ref32), rel(ours16, ref32)
    # ours rounds once per op, transformers' bf16 path more often: no farther from
    # float32 than transformers' own bf16 run (with a margin for an unlucky seed)
    assert e_ours < 0.2 and e_ours < 1.5 * e_hf, (e_ours, e_hf)



def test_single_attention_module():
    """swap() on one DeepseekV4Attention (layer-level use): same output as its own
    forward under the causal mask, with mask None."""
    from transformers.masking_utils import create_sliding_window_causal_mask
    m = make_model(layer_types=["compressed_sparse_attention"], seed=8)
    attn = m.model.layers[0].self_attn
    x = torch.randn(2, 45, 64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(45)[None]
    pe = {k: m.model.rotary_emb(x, pos, layer_type=k) for k in ("main", "compress")}
    with torch.no_grad():
        mask = create_sliding_window_causal_mask(config=m.config, inputs_embeds=x,
                                                 attention_mask=None, past_key_values=None,
                                                 position_ids=pos)
        ref = attn(x, pe, pos, mask, None)[0]
        with dch.swapped(attn):
            got = attn(x, pe, pos, None, None)[0]
    assert rel(got, ref) < 1e-5
    assert "forward" not in attn.__dict__


@contextlib.contextmanager
def qat_reference(model):
    """transformers' own forward with model.py's QAT roundings added by hooks, from the
    float32 torch reference quantizers (deepseek_csa.reference.quant, not our kernels):
    FP8 in blocks of 64 on every KV row's and compressed entry's features in front of
    the rope tail (rounded at the RMSNorm's output: the rope touches only the tail, so
    this is the same as rounding after it), and Hadamard + FP4 in blocks of 32 on the
    indexer's queries and keys (at the scorer's input, after their rope)."""
    from deepseek_csa.reference import quant as Q
    cfg = model.config
    rd = int(round(cfg.head_dim * cfg.partial_rotary_factor))

    def fp8_front(mod, inp, out):
        return torch.cat([Q.fp8_round(out[..., :-rd], 64).to(out.dtype), out[..., -rd:]], -1)

    def had_fp4(x):
        return Q.fp4_round(Q.hadamard(x), 32).to(x.dtype)

    def scorer_in(mod, args):
        q, k, h = args
        return had_fp4(q), had_fp4(k), h

    hooks = []
    for layer in model.model.layers:
        a = layer.self_attn
        hooks.append(a.kv_norm.register_forward_hook(fp8_front))
        comp = getattr(a, "compressor", None)
        if comp is not None:
            hooks.append(comp.kv_norm.register_forward_hook(fp8_front))
            ix = getattr(comp, "indexer", None)
            if ix is not None:
                hooks.append(ix.scorer.register_forward_pre_hook(scorer_in))
    try:
        yield model
    finally:
        for h in hooks:
            h.remove()


def test_qat_option():
    """qat=True adds model.py's FP8 (KV rows, compressed entries) and Hadamard + FP4
    (indexer) roundings: compared with transformers' forward with those roundings added
    by the float32 torch reference quantizers (qat_reference), prefill and a decode
    step.  Error budget: float32 order differences, measured 3.5e-7 (prefill) and
    3.8e-7 (decode) relative on the logits; 1e-5.  Without the roundings the logits
    move by 0.24 (the FP4 indexer keys change the top-k)."""
    with pytest.raises(ValueError, match="qat"):
        dch.swap(make_model(), qat=True)     # 24 features before the rope tail
    model4 = make_model(head_dim=72, partial_rotary_factor=8 / 72, index_head_dim=32)
    ids = ids_for(2, 60, seed=17)
    nxt = ids_for(2, 1, seed=18)
    with torch.no_grad():
        plain = model4(ids).logits
        with qat_reference(model4):
            ref = model4(ids).logits
            ref_dec = model4(nxt, past_key_values=model4(ids, use_cache=True)
                             .past_key_values).logits
        with dch.swapped(model4, qat=True):
            q = model4(ids).logits
            dec = model4(nxt, past_key_values=model4(ids, use_cache=True)
                         .past_key_values).logits
    assert rel(plain, ref) > 1e-2          # the roundings matter on these inputs
    assert rel(q, ref) < 1e-5, rel(q, ref)
    assert rel(dec, ref_dec) < 1e-5, rel(dec, ref_dec)
