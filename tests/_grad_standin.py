"""STAND-IN for the differentiable deepseek_csa.torch ops (docs/kernels.md section 11), in
plain torch (autograd does the backward).  Test-only: in tests/test_grad_transformers.py's
'standin' mode it serves ``deepseek_csa.torch.indexer_kl_loss`` for capture_indexer's
records, so the KL objective's wiring is checked against torch autograd independently of
our C backward kernels (the swapped attention itself calls the torch.ops.deepseek_csa
operators in both modes; their backward kernels are checked by tests/test_grad_*.py and
tests/test_ops.py).  Same names, signatures and semantics:

    sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale)            differentiable
    sparse_attn_weights(q, kv, attn_sink, topk_idxs, softmax_scale)    no grad
    rms_norm(x, weight=None, eps=1e-6)                                 differentiable
    apply_rotary_emb(x, freqs_cis, inverse=False)                      differentiable (x)
    gated_pool(kv, score, ratio, *, ape=None, overlap=False)           differentiable
    index_scores(q, k, weights, *, ratio, start_pos=0)                 differentiable
    indexer_kl_loss(q, k, weights, topk_idxs, attn_target, *, ratio, start_pos=0,
                    positions=None, target="selected", clip=None)

``install(monkeypatch)`` patches them onto ``deepseek_csa.torch`` (the committed code
resolves the names there at call time).  Never used outside the tests.  Written from
docs/kernels.md, not from any other implementation.
"""
import torch

NAMES = ("sparse_attn", "sparse_attn_weights", "rms_norm", "apply_rotary_emb",
         "gated_pool", "index_scores", "indexer_kl_loss")
# the names the real ops add to deepseek_csa.torch (the other three exist today, forward-only)
NEW_NAMES = ("sparse_attn_weights", "gated_pool", "index_scores", "indexer_kl_loss")


def real_ops_available():
    import deepseek_csa.torch as dct
    return all(hasattr(dct, n) for n in NEW_NAMES)


def install(monkeypatch):
    import deepseek_csa.torch as dct
    g = globals()
    for n in NAMES:
        monkeypatch.setattr(dct, n, g[n], raising=False)


def _probs(q, kv, attn_sink, topk_idxs, softmax_scale):
    """[B, S, H, K] attention probabilities (the sink's share left out) and the gathered
    rows [B, S, K, D]."""
    idx = topk_idxs.long()
    valid = idx >= 0
    B, S, K = idx.shape
    rows = torch.gather(kv.float().unsqueeze(1).expand(B, S, -1, -1), 2,
                        idx.clamp(min=0).unsqueeze(-1).expand(B, S, K, kv.shape[-1]))
    logits = torch.einsum("bshd,bskd->bshk", q.float(), rows) * softmax_scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    sink = attn_sink.float().view(1, 1, -1, 1).expand(B, S, -1, 1)
    p = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return p, rows


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    p, rows = _probs(q, kv, attn_sink, topk_idxs, softmax_scale)
    return torch.einsum("bshk,bskd->bshd", p, rows).to(q.dtype)


def sparse_attn_weights(q, kv, attn_sink, topk_idxs, softmax_scale):
    with torch.no_grad():
        p, _ = _probs(q.detach(), kv.detach(), attn_sink.detach(), topk_idxs,
                      softmax_scale)
        return p.sum(2).float()


def rms_norm(x, weight=None, eps=1e-6):
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def apply_rotary_emb(x, freqs_cis, inverse=False):
    """Out of place (the real one may rotate in place and return x: callers use the
    result).  Interleaved pairs, freqs_cis [S, n/2] complex."""
    fc = freqs_cis.conj() if inverse else freqs_cis
    shape = x.shape
    xc = torch.view_as_complex(x.float().reshape(*shape[:-1], -1, 2).contiguous())
    if x.dim() == 4:
        fc = fc.view(1, shape[1], 1, -1)
    else:
        fc = fc.view(1, shape[1], -1)
    return torch.view_as_real(xc * fc).reshape(shape).to(x.dtype)


def gated_pool(kv, score, ratio, *, ape=None, overlap=False):
    B, T, cD = kv.shape
    c = 2 if overlap else 1
    D = cD // c
    n = T // ratio
    kv4 = kv[:, :n * ratio].float().reshape(B, n, ratio, cD)
    sc = score[:, :n * ratio].float().reshape(B, n, ratio, cD)
    if ape is not None:
        sc = sc + ape.float()
    if not overlap:
        return (torch.softmax(sc, dim=2) * kv4).sum(2).to(kv.dtype)
    prev_kv = torch.cat([kv4.new_zeros(B, 1, ratio, D), kv4[:, :-1, :, :D]], dim=1)
    prev_sc = torch.cat([sc.new_full((B, 1, ratio, D), float("-inf")), sc[:, :-1, :, :D]],
                        dim=1)
    ckv = torch.cat([prev_kv, kv4[..., D:]], dim=2)
    csc = torch.cat([prev_sc, sc[..., D:]], dim=2)
    return (torch.softmax(csc, dim=2) * ckv).sum(2).to(kv.dtype)


def _visible(S, Tc, ratio, start_pos, device=None):
    vis = (start_pos + torch.arange(S, device=device) + 1) // ratio
    return torch.arange(Tc, device=device)[None, :] < vis[:, None]          # [S, Tc]


def index_scores(q, k, weights, *, ratio, start_pos=0):
    s = torch.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()))
    s = (s * weights.float().unsqueeze(-1)).sum(2)
    vis = _visible(q.shape[1], k.shape[1], ratio, start_pos, q.device)
    return s.masked_fill(~vis[None], float("-inf"))


def indexer_kl_loss(q, k, weights, topk_idxs, attn_target, *, ratio, start_pos=0,
                    positions=None, target="selected", clip=None):
    scores = index_scores(q, k, weights, ratio=ratio, start_pos=start_pos)   # [B, S, Tc]
    if positions is not None:       # each query's own position: t < (P + 1) // ratio
        P = torch.as_tensor(positions).long().expand(q.shape[0], q.shape[1])
        vis = torch.arange(k.shape[1], device=q.device) < ((P + 1) // ratio)[..., None]
        scores = torch.where(vis, index_scores(q, k, weights, ratio=1,
                                               start_pos=k.shape[1]), float("-inf"))
    if topk_idxs is None:
        valid = torch.isfinite(scores)
        I, tgt = scores, attn_target.float()
    else:
        idx = topk_idxs.long()
        valid = idx >= 0
        I = torch.gather(scores, 2, idx.clamp(min=0)).masked_fill(~valid, float("-inf"))
        tgt = attn_target.float()
    tgt = torch.where(valid, tgt, torch.zeros_like(tgt))
    Z = tgt.sum(-1, keepdim=True)
    p = tgt / Z.clamp_min(1e-30)
    logq = torch.log_softmax(I, dim=-1)
    if clip is not None:
        logq = torch.clamp(logq, min=clip)
    term = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-30)) - logq),
                       torch.zeros_like(p))
    rows = valid.any(-1) & (Z[..., 0] != 0)
    per_row = term.sum(-1) * (Z[..., 0] if target == "joint" else 1.0)
    return per_row[rows].sum() / rows.sum().clamp_min(1)
