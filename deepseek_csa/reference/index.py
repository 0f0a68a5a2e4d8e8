"""Float32 torch reference of the indexer and the index lists, written from docs/kernels.md
sections 4 and 6 (plus NumPy statements of our exact tie-breaking contract)."""
import numpy as np
import torch

NEG_INF = float("-inf")


def visible(start_pos, S, ratio):
    """Compressed entries each query row can see: t < (P + 1) // ratio, P = start_pos + s."""
    return (start_pos + torch.arange(S) + 1) // ratio


def index_scores(q, k, w, ratio, start_pos=0):
    """kernels.md section 4: sum_h relu(q . k) * w, float32 (or the inputs' dtype), -inf where invisible."""
    s = torch.einsum("bshd,btd->bsht", q, k).relu()
    s = (s * w[..., None]).sum(2)
    Tc = k.shape[1]
    hidden = torch.arange(Tc)[None, None, :] >= visible(start_pos, q.shape[1], ratio)[None, :, None]
    return s.masked_fill(hidden, NEG_INF)


def eligible(B, S, Tc, ratio, start_pos, candidates=None, block_size=None):
    """bool [B, S, Tc]: visible and (when given) inside a kept candidate block."""
    e = torch.arange(Tc)[None, None, :] < visible(start_pos, S, ratio)[None, :, None]
    e = e.expand(B, S, Tc).clone()
    if candidates is not None:
        e &= torch.as_tensor(candidates).repeat_interleave(block_size, dim=-1)[..., :Tc]
    return e


def topk_indices(scores, topk, ratio, start_pos=0, offset=0, order="score", candidates=None,
                 block_size=None):
    """kernels.md section 4 with torch.topk (ties in any order): int32 [B, S, min(topk, (p+S)//r)],
    ineligible entries -1, the others + offset; "position" sorts each row ascending with
    the -1s last."""
    B, S, Tc = scores.shape
    K = min(topk, (start_pos + S) // ratio)
    e = eligible(B, S, Tc, ratio, start_pos, candidates, block_size)
    s = scores.masked_fill(~e, NEG_INF)
    idx = s.topk(K, dim=-1).indices
    ok = torch.gather(e, -1, idx)
    # ineligible entries win only when a row has fewer than K eligible ones: drop them
    idx = torch.where(ok, idx + offset, torch.full_like(idx, -1))
    if order == "position":
        key = torch.where(idx < 0, torch.full_like(idx, 2**40), idx)
        idx = torch.gather(idx, -1, key.argsort(dim=-1))
    else:  # keep the ranking but move the -1s (all at the end already: they score -inf)
        pass
    return idx.to(torch.int32)


def index_topk(q, k, w, topk, ratio, start_pos=0, offset=0, order="score", candidates=None,
               block_size=None):
    return topk_indices(index_scores(q, k, w, ratio, start_pos), topk, ratio, start_pos, offset,
                        order, candidates, block_size)


# ---------------------------------------------------------------- exact contract (NumPy)

def rank_key(scores):
    """Sort key of our ranking: NaN highest, -0.0 == +0.0; higher ranks first."""
    s = np.asarray(scores, np.float64)
    return np.where(np.isnan(s), np.inf, s), np.isnan(s)


def exact_topk(scores, topk, ratio, start_pos=0, offset=0, order="score", candidates=None,
               block_size=None):
    """Our documented contract, row by row: the K best eligible entries by (score desc,
    NaN first, position asc), written as t + offset, -1 padding at the end."""
    scores = np.asarray(scores, np.float32)
    B, S, Tc = scores.shape
    K = min(topk, (start_pos + S) // ratio)
    e = eligible(B, S, Tc, ratio, start_pos, candidates, block_size).numpy()
    out = np.full((B, S, K), -1, np.int32)
    for b in range(B):
        for s in range(S):
            t = np.nonzero(e[b, s])[0]
            v = scores[b, s, t].astype(np.float64)
            nan = np.isnan(v)
            v = np.where(nan, 0.0, v)
            order_ix = np.lexsort((t, -v, ~nan))  # NaN first, then score desc, then position
            sel = t[order_ix][:K]
            if order == "position":
                sel = np.sort(sel)
            out[b, s, :len(sel)] = sel + offset
    return out


def exact_candidate_blocks(scores, topk_blocks, block_size, ratio, start_pos=0):
    """kernels.md section 4 (V4.1 level one) with our tie rule: bool [B, S, ceil(Tc / bs)]."""
    scores = np.asarray(scores, np.float32)
    B, S, Tc = scores.shape
    nb = -(-Tc // block_size)
    out = np.zeros((B, S, nb), bool)
    for b in range(B):
        for s in range(S):
            nv = min((start_pos + s + 1) // ratio, Tc)
            if nv == 0:
                continue
            forced = (nv - 1) // block_size
            out[b, s, forced] = True
            blocks = [scores[b, s, j * block_size:(j + 1) * block_size].astype(np.float64)
                      for j in range(forced)]
            has_nan = np.array([np.isnan(v).any() for v in blocks], bool)
            best = np.array([0.0 if n else v.max() for v, n in zip(blocks, has_nan)])
            # NaN-holding blocks first, then by max desc, then by lower block index
            ix = np.lexsort((np.arange(forced), -best, ~has_nan))
            out[b, s, ix[:topk_blocks - 1]] = True
    return out


# ---------------------------------------------------------------- index lists (kernels.md section 4, 6)

def window_topk_idxs(window, batch, seqlen, start_pos):
    if start_pos == 0:
        W = min(seqlen, window)
        s = torch.arange(seqlen)[:, None]
        j = torch.arange(W)[None, :]
        pos = (s - window + 1).clamp(min=0) + j
        idx = torch.where(pos > s, torch.full_like(pos, -1), pos)
    elif start_pos >= window - 1:
        idx = ((start_pos + 1 + torch.arange(window)) % window)[None, :]
    else:
        j = torch.arange(window)
        idx = torch.where(j <= start_pos, j, torch.full_like(j, -1))[None, :]
    return idx.expand(batch, *idx.shape).to(torch.int32)


def compress_topk_idxs(ratio, batch, seqlen, start_pos, offset):
    if start_pos == 0:
        t = torch.arange(seqlen // ratio)[None, :]
        vis = (torch.arange(seqlen) + 1)[:, None] // ratio
        idx = torch.where(t < vis, t + offset, torch.full_like(t, -1))
    else:
        idx = (torch.arange((start_pos + 1) // ratio) + offset)[None, :]
    return idx.expand(batch, *idx.shape).to(torch.int32)
