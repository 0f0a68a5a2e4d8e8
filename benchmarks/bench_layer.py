"""A whole V4-Flash attention layer: CSA (ratio 4) and HCA (ratio 128) prefill of 4096 tokens
without the dense projections (both sides start from the same projected tensors and end at
the de-rotated attention output), and a full decode step after the prefill.

Ours: deepseek_csa.layer.CSALayer.attend / forward.  Reference: the float32 torch layer of
deepseek_csa.reference.layer, processed in query chunks of 512 (its unchunked form would gather
[4096, 640, 512] floats, 5.4 GB) -- and torch.compile of it.
"""
import numpy as np
import torch

import deepseek_csa as dc  # noqa: E402
from deepseek_csa.reference import layer as R  # noqa: E402
from harness import Case  # noqa: E402

from deepseek_csa.layer import CSALayer  # noqa: E402


def _rope(x, cos, sin, inverse=False):
    """In-place RoPE of adjacent pairs with real cos/sin tables [S, Dr/2] (no complex
    tensors, which Inductor does not generate code for)."""
    shape = [1, x.shape[1]] + [1] * (x.dim() - 3) + [cos.shape[-1]]
    c, s = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        s = -s
    ev, od = x[..., 0::2].clone(), x[..., 1::2].clone()
    x[..., 0::2] = ev * c - od * s
    x[..., 1::2] = ev * s + od * c
    return x


def _ref_core(q, kv, ckv, csc, iq, iw, ickv, icsc, ape, iape, kvn, cn, icn, sink, cos, sin,
              window: int, ratio: int, topk: int, eps: float):
    """Reference prefill core: everything between the projections, float32 torch."""
    S, rd = q.shape[1], 64
    q = q.clone()
    qf = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)
    _rope(qf[..., -rd:], cos[:S], sin[:S])
    kvh = kv * torch.rsqrt(kv.square().mean(-1, keepdim=True) + eps) * kvn
    _rope(kvh[..., -rd:], cos[:S], sin[:S])
    kvh[..., :-rd] = R.fp8_qat(kvh[..., :-rd], 64)
    idx = R.get_window_topk_idxs(window, 1, S, 0)
    g = S // ratio
    d = kv.shape[-1]

    def pool(kvp, scp, a, overlap, nw):
        c = 2 if overlap else 1
        kvp = kvp[:, :g * ratio].reshape(1, g, ratio, c * kvp.shape[-1] // c)
        scp = scp[:, :g * ratio].reshape(1, g, ratio, -1) + a
        if overlap:
            dd = kvp.shape[-1] // 2
            pk = torch.cat((torch.zeros_like(kvp[:, :1, :, :dd]), kvp[:, :-1, :, :dd]), 1)
            ps = torch.cat((torch.full_like(scp[:, :1, :, :dd], float("-inf")),
                            scp[:, :-1, :, :dd]), 1)
            kvp, scp = torch.cat((pk, kvp[..., dd:]), 2), torch.cat((ps, scp[..., dd:]), 2)
        e = (kvp * torch.softmax(scp, 2)).sum(2)
        e = e * torch.rsqrt(e.square().mean(-1, keepdim=True) + eps) * nw
        _rope(e[..., -rd:], cos[:g * ratio:ratio], sin[:g * ratio:ratio])
        return e

    if ratio == 4:
        ik = R.hadamard(pool(ickv, icsc, iape, True, icn))
        ik = R.fp4_qat(ik, 32)
        iqq = iq.clone()
        _rope(iqq[..., -rd:], cos[:S], sin[:S])
        iqq = R.fp4_qat(R.hadamard(iqq), 32)
        sc = R._causal_mask(R._scores(iqq, ik, iw), ratio, 0)
        cidx = R._index_select(sc, topk, ratio, 0, S, False)
    else:
        cidx = R.get_compress_topk_idxs(ratio, 1, S, 0, S)
    e = pool(ckv, csc, ape, ratio == 4, cn)
    e[..., :-rd] = R.fp8_qat(e[..., :-rd], 64)
    allkv = torch.cat((kvh, e), 1)
    o = R.sparse_attn(qf, allkv, sink, torch.cat((idx, cidx), -1).int(), d ** -0.5)
    _rope(o[..., -rd:], cos[:S], sin[:S], True)
    return o


def _prefill_case(ratio, S, rng):
    cfg = dc.V4_FLASH
    H, D, Hi, Di = cfg.n_heads, cfg.head_dim, cfg.index_heads, cfg.index_head_dim
    # the attention part of the weights; projections are not run here
    w = {k: v for k, v in dc_layer_weights(cfg, ratio, rng).items()}
    layer = CSALayer(w, cfg, ratio=ratio, batch=1, max_seq_len=S)
    c = 2 if ratio == 4 else 1
    f32 = lambda *s: (rng.standard_normal(s, dtype=np.float32))  # noqa: E731
    inp = {"x": np.empty((1, S, 0), np.float32), "q": f32(1, S, H, D), "kv": f32(1, S, D),
           "ckv": f32(1, S, c * D), "cscore": f32(1, S, c * D)}
    if ratio == 4:
        inp.update(iq=f32(1, S, Hi, Di), iw=f32(1, S, Hi) * 0.01, ickv=f32(1, S, 2 * Di),
                   icscore=f32(1, S, 2 * Di))
    work = {k: v.copy() for k, v in inp.items()}

    def ours():
        for k in ("q", "kv", "iq"):
            if k in inp:
                np.copyto(work[k], inp[k])  # attend works in place; the copy is counted
        layer.reset()
        return layer.attend(work, 0)

    T = torch.from_numpy
    fc = R.precompute_freqs_cis(64, S, cfg.original_seq_len, cfg.compress_rope_theta,
                                cfg.yarn_factor, cfg.beta_fast, cfg.beta_slow)
    args = (T(inp["q"]), T(inp["kv"]), T(inp["ckv"]), T(inp["cscore"]),
            T(inp.get("iq", np.zeros((1, S, 1, 1), np.float32))),
            T(inp.get("iw", np.zeros((1, S, 1), np.float32))),
            T(inp.get("ickv", np.zeros((1, S, 1), np.float32))),
            T(inp.get("icscore", np.zeros((1, S, 1), np.float32))),
            T(w["compressor.ape"]), T(w.get("indexer.compressor.ape", np.zeros(1, np.float32))),
            T(w["kv_norm.weight"]), T(w["compressor.norm.weight"]),
            T(w.get("indexer.compressor.norm.weight", np.zeros(1, np.float32))),
            T(w["attn_sink"]), fc.real.contiguous(), fc.imag.contiguous(), cfg.window, ratio,
            cfg.index_topk, cfg.norm_eps)
    # only what a causal prefill computes: row s attends min(window, s + 1) raw tokens and
    # its visible compressed entries ((s + 1) // ratio, at most index_topk at ratio 4), and
    # the indexer scores those (s + 1) // 4 entries
    s_ = np.arange(S)
    vis = (s_ + 1) // ratio
    slots = np.minimum(cfg.window, s_ + 1) + (np.minimum(cfg.index_topk, vis) if ratio == 4 else vis)
    flops = 4.0 * H * D * float(slots.sum()) + (2.0 * Hi * Di * float(vis.sum()) if ratio == 4 else 0)
    name = f"V4-Flash ratio {ratio} prefill S={S} (no projections)"
    return Case("layer", name, ours=ours, eager=lambda: _ref_core(*args), compile_fn=_ref_core,
                compile_args=args, flops=flops, bound="compute", reps=3)


def dc_layer_weights(cfg, ratio, rng):
    from deepseek_csa.layer import layer_weight_shapes
    out = {}
    for name, shp in layer_weight_shapes(cfg, ratio).items():
        if name.startswith(("wq_", "wo_", "wkv.", "compressor.w", "indexer.w",
                            "indexer.compressor.w")):
            out[name] = np.zeros(shp, np.float32)  # not used by attend()
        elif name.endswith("norm.weight"):
            out[name] = 1 + 0.1 * rng.standard_normal(shp, dtype=np.float32)
        else:
            out[name] = rng.standard_normal(shp, dtype=np.float32)
    return out


def _decode_case(S, rng):
    """One decode token after an S-token prefill, projections included, both sides."""
    cfg = dc.V4_FLASH
    args = R.ModelArgs(max_batch_size=1, max_seq_len=S + 1024, dim=cfg.dim, n_heads=cfg.n_heads,
                       head_dim=cfg.head_dim, rope_head_dim=cfg.rope_dim,
                       q_lora_rank=cfg.q_lora_rank, o_lora_rank=cfg.o_lora_rank,
                       o_groups=cfg.o_groups, window_size=cfg.window, compress_ratios=(4,),
                       index_n_heads=cfg.index_heads, index_head_dim=cfg.index_head_dim,
                       index_topk=cfg.index_topk)
    ref = R.randomize(R.Attention(0, args), 0)
    w = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    ours_l = CSALayer(w, cfg, ratio=4, batch=1, max_seq_len=S + 1024)
    x = rng.standard_normal((1, S + 1024, cfg.dim), dtype=np.float32) * 0.5
    with torch.no_grad():
        ours_l(x[:, :S], 0)
        ref(torch.from_numpy(x[:, :S]), 0)
    st = {"o": S, "r": S}

    def ours():
        p = st["o"]
        st["o"] += 1
        return ours_l(x[:, p:p + 1], p)

    def eager():
        p = st["r"]
        st["r"] += 1
        with torch.no_grad():
            return ref(torch.from_numpy(x[:, p:p + 1]), p)

    return Case("layer", f"V4-Flash ratio 4 decode step after {S} (with projections)",
                ours=ours, eager=eager, reps=20)


def cases(quick=False):
    rng = np.random.default_rng(0)
    S = 512 if quick else 4096
    return [_prefill_case(4, S, rng), _prefill_case(128, S, rng), _decode_case(S, rng)]
