"""capture_indexer: per CSA layer, the indexer's q / k / weights (from inputs detached
from the main graph), its selection and the main attention's target, for the indexer's
KL objective."""
from __future__ import annotations

import contextlib

from . import attention as _att
from .versions import _torch

def _capture_reason(pad, position_ids, S):
    """capture_indexer's records take one start position (the KL loss's ``start_pos``):
    a padded batch or positions that differ per row / are not one arange fall back."""
    if pad is not None:
        return "capture_indexer with a padded batch (2-D attention mask with zeros)"
    if position_ids is not None:
        torch = _torch()
        p = position_ids.detach().reshape(-1, S)
        if not bool((p == p[:1, :1] + torch.arange(S)).all()):
            return "capture_indexer with position ids that differ per row or skip"
    return None


def _indexer_inputs(h, qr):
    """The indexer's inputs cut from the main graph (it learns only from its KL loss)."""
    return h.detach(), qr.detach()


def _indexer_capture(st, m, layer, h, qr, cos, sin, pos, off, T, grad_mode):
    """The indexer under capture_indexer: q / k / weights computed by the operators
    from the *detached* hidden states and query residual (the indexer learns only from
    its KL loss), the selection from their values, recorded for the layer.  The
    positions are one row, one arange (``_layer_reason`` falls back otherwise: the KL
    loss takes one ``start_pos``)."""
    torch = _torch()
    comp = m.compressor
    ix = comp.indexer
    B, S, _ = h.shape
    start = int(pos[0, 0]) if pos.numel() else 0
    with torch.set_grad_enabled(grad_mode):
        hd, qrd = _indexer_inputs(h, qr)
        keys = _att._compress(ix, layer, "indexer", hd, True,
                              _att._qat_index if st.qat else None)
        if not T:
            return None, None
        qi = _att._rope(ix.q_b_proj(qrd).view(B, S, ix.num_heads, ix.head_dim), cos, sin)
        if st.qat:
            qi = _att._qat_index(qi)
        w = ix.scorer.weights_proj(hd).float() * (ix.scorer.weights_scaling
                                                  * ix.scorer.softmax_scale)
        keys = keys.to(qi.dtype)
    with torch.no_grad():
        sel = _att._index_select(qi.detach(), keys.detach(), w.detach(), ix.index_topk,
                                 comp.compress_rate, pos, start, off)
    sel_pos = torch.where(sel >= 0, sel - off, -1).to(torch.int32)
    rec = IndexerRecord(m.layer_idx, qi, keys, w, sel_pos, comp.compress_rate, start)
    st.capture._layers[m.layer_idx] = rec
    return sel, rec


def _capture_target(st, m, rec, q, kvbuf, idx, pos, off, T):
    """The record's attention targets from the main attention's own inputs (no grad):
    sparse_attn_weights over the layer's lists (window + selected entries; the selected
    slots are the last K), and with ``dense=True`` over window + every visible entry."""
    torch = _torch()
    B, S = idx.shape[0], idx.shape[1]
    K = rec.topk_idxs.shape[-1]
    qd, kd = q.detach(), kvbuf.detach()
    sink = _att._f32(m.sinks.detach()).contiguous()
    with torch.no_grad():
        w = _att._call("sparse_attn_weights", qd, kd, sink, idx, float(m.scaling))
        rec.attn_target = w[..., idx.shape[-1] - K:].float().contiguous()
        if st.capture.dense:
            win = idx[..., :idx.shape[-1] - K]
            a = _att._all_idx(_att._visible(pos, rec.ratio, T), T, off)
            full = torch.cat([win, a.expand(B, S, T)], dim=-1).contiguous()
            wd = _att._call("sparse_attn_weights", qd, kd, sink, full,
                       float(m.scaling))[..., win.shape[-1]:]
            dense = torch.zeros((B, S, T), dtype=torch.float32)
            dense[..., :wd.shape[-1]] = wd
            rec.dense_target = dense


class IndexerRecord:
    """What one CSA layer's last forward used, for the indexer's KL objective:

    - ``q`` [B, S, Hi, Di], ``k`` [B, Tc, Di], ``weights`` [B, S, Hi] float32: the
      indexer's queries (after RoPE), compressed keys (all Tc entries so far) and head
      weights (scaled as the scorer does), computed from inputs detached from the main
      graph: they carry gradient to the indexer's own parameters only;
    - ``topk_idxs`` [B, S, K] int32: the selected entries (compressed positions, -1 =
      none), no gradient;
    - ``attn_target`` [B, S, K] float32: the main attention's probability at each
      selected slot summed over heads (``sparse_attn_weights``), no gradient;
    - ``dense_target`` [B, S, Tc] float32 (only under ``capture_indexer(dense=True)``):
      the same over every visible entry, from the attention over window + all of them;
    - ``ratio``, ``start_pos``, ``layer`` (the decoder layer index).
    """

    __slots__ = ("layer", "q", "k", "weights", "topk_idxs", "attn_target", "dense_target",
                 "ratio", "start_pos")

    def __init__(self, layer, q, k, weights, topk_idxs, ratio, start_pos):
        self.layer, self.q, self.k, self.weights = layer, q, k, weights
        self.topk_idxs, self.ratio, self.start_pos = topk_idxs, ratio, start_pos
        self.attn_target = self.dense_target = None

    def loss(self, dense=False):
        """``deepseek_csa.torch.indexer_kl_loss`` of this layer: the sparse stage (the
        selected set), or with ``dense=True`` the warm-up over every visible entry."""
        dct = _att._dct()
        if dense:
            if self.dense_target is None:
                raise RuntimeError("IndexerRecord.loss(dense=True) needs "
                                   "capture_indexer(model, dense=True)")
            return dct.indexer_kl_loss(self.q, self.k, self.weights, None, self.dense_target,
                                       ratio=self.ratio, start_pos=self.start_pos)
        return dct.indexer_kl_loss(self.q, self.k, self.weights, self.topk_idxs,
                                   self.attn_target, ratio=self.ratio,
                                   start_pos=self.start_pos)


class IndexerCapture:
    """Handed out by ``capture_indexer``: ``layers`` (one ``IndexerRecord`` per swapped
    CSA layer that had compressed entries in the last forward, in layer order) and
    ``loss()`` (the sum of their KL losses)."""

    def __init__(self, dense=False):
        self.dense = bool(dense)
        self._layers = {}

    @property
    def layers(self):
        return [self._layers[i] for i in sorted(self._layers)]

    def loss(self, dense=None):
        """Sum over the recorded layers of ``indexer_kl_loss`` (``dense`` defaults to the
        capture's own setting)."""
        dense = self.dense if dense is None else bool(dense)
        recs = self.layers
        if not recs:
            raise RuntimeError("capture_indexer: no CSA layer with compressed entries ran "
                               "in the captured forward")
        total = recs[0].loss(dense)
        for r in recs[1:]:
            total = total + r.loss(dense)
        return total

    def clear(self):
        self._layers = {}


@contextlib.contextmanager
def capture_indexer(model, *, dense: bool = False):
    """``with capture_indexer(model) as cap: model(ids); loss = cap.loss()``.

    Every swapped CSA layer records, per forward (the last one wins), its indexer's
    q / k / weights -- computed through the differentiable ops from its inputs *detached*
    from the main graph, so ``cap.loss().backward()`` reaches only the indexers'
    parameters (as DeepSeek trains the indexer: it learns only from its KL loss, the
    model only from the LM loss) -- the selected indices and their attention target
    (``sparse_attn_weights``, no grad).  ``dense=True`` also records the warm-up target
    over every visible entry (``cap.loss()`` then is the dense KL).  The model is swapped
    for the block if it was not.  Grad mode is the caller's: freeze the rest of the model
    (``requires_grad_(False)``) and the main path runs on the inference kernels."""
    from .swap import _ATTR, _base, is_swapped, swap, unswap
    missing = _att._missing_grad_ops(_att._GRAD_ALL)
    if missing:
        raise RuntimeError(f"capture_indexer needs the differentiable ops of "
                           f"deepseek_csa.torch ({', '.join(missing)} missing in this build)")
    base = _base(model)
    own = not is_swapped(model)
    if own:
        swap(model)
    st = getattr(base, _ATTR)
    if st.capture is not None:
        raise RuntimeError("capture_indexer: this model is already being captured")
    cap = st.capture = IndexerCapture(dense)
    try:
        yield cap
    finally:
        st.capture = None
        if own:
            unswap(model)
