"""capture_indexer: per CSA layer, the indexer's q / k / weights (from inputs detached
from the main graph), its selection and the main attention's target, for the indexer's
KL objective."""
from __future__ import annotations

import contextlib

from . import attention as _att
from .versions import _torch


def _indexer_inputs(h, qr):
    """The indexer's inputs cut from the main graph (it learns only from its KL loss)."""
    return h.detach(), qr.detach()


def _indexer_capture(st, m, layer, h, qr, cos, sin, pos, start, off, T, grad_mode):
    """The indexer under capture_indexer: q / k / weights computed by the operators
    from the *detached* hidden states and query residual (the indexer learns only from
    its KL loss), the selection from their values (as the inference path selects:
    ``start`` a Python int when every row's positions are start .. start + S - 1, else
    None and each query's own position), recorded for the layer with the positions
    the KL loss needs: ``start_pos`` in the first case, per-query ``positions`` in the
    other (padded batches, position ids per row)."""
    torch = _torch()
    comp = m.compressor
    ix = comp.indexer
    B, S, _ = h.shape
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
    positions = None
    if start is None:
        positions = pos.expand(B, S).to(torch.int32).contiguous()
    if st.pad_mask is not None:
        # pad queries are not part of their row: no slots, so they take no part
        real = st.pad_mask[:, st.pad_mask.shape[1] - S:]
        sel_pos = torch.where(real[..., None], sel_pos, -1)
    rec = IndexerRecord(m.layer_idx, qi, keys, w, sel_pos, comp.compress_rate,
                        0 if start is None else start, positions, m.num_heads,
                        st.capture.target, st.capture.clip)
    st.capture._layers[m.layer_idx] = rec
    return sel, rec


def _capture_target(st, m, rec, q, kvbuf, idx, pos, off, T):
    """The record's attention targets from the main attention's own inputs (no grad):
    sparse_attn_weights over the layer's lists (window + selected entries; the selected
    slots are the last K), and with ``dense=True`` over window + every visible entry.
    Pad queries' targets are 0 (they take no part)."""
    torch = _torch()
    B, S = idx.shape[0], idx.shape[1]
    K = rec.topk_idxs.shape[-1]
    qd, kd = q.detach(), kvbuf.detach()
    sink = _att._f32(m.sinks.detach()).contiguous()
    real = None
    if st.pad_mask is not None:
        real = st.pad_mask[:, st.pad_mask.shape[1] - S:, None]
    with torch.no_grad():
        w = _att._call("sparse_attn_weights", qd, kd, sink, idx, float(m.scaling))
        tgt = w[..., idx.shape[-1] - K:].float()
        rec.attn_target = (tgt if real is None else torch.where(real, tgt, 0.0)).contiguous()
        if st.capture.dense:
            win = idx[..., :idx.shape[-1] - K]
            a = _att._all_idx(_att._visible(pos, rec.ratio, T), T, off)
            full = torch.cat([win, a.expand(B, S, T)], dim=-1).contiguous()
            wd = _att._call("sparse_attn_weights", qd, kd, sink, full,
                       float(m.scaling))[..., win.shape[-1]:]
            dense = torch.zeros((B, S, T), dtype=torch.float32)
            dense[..., :wd.shape[-1]] = wd
            rec.dense_target = dense if real is None else torch.where(real, dense, 0.0)


class IndexerRecord:
    """What one CSA layer's last forward used, for the indexer's KL objective:

    - ``q`` [B, S, Hi, Di], ``k`` [B, Tc, Di], ``weights`` [B, S, Hi] float32: the
      indexer's queries (after RoPE), compressed keys (all Tc entries so far) and head
      weights (scaled as the scorer does), computed from inputs detached from the main
      graph: they carry gradient to the indexer's own parameters only;
    - ``topk_idxs`` [B, S, K] int32: the selected entries (compressed positions, -1 =
      none; a padded batch's pad queries have none), no gradient;
    - ``attn_target`` [B, S, K] float32: the main attention's probability at each
      selected slot summed over heads (``sparse_attn_weights``), no gradient;
    - ``dense_target`` [B, S, Tc] float32 (only under ``capture_indexer(dense=True)``):
      the same over every visible entry, from the attention over window + all of them;
    - ``ratio``, ``start_pos``, ``positions`` (int32 [B, S], each query's position, when
      the rows' positions are not one shared arange -- padded batches, position ids per
      row -- else None), ``n_heads`` (the main attention's heads, which the targets sum
      over), ``layer`` (the decoder layer index).
    """

    __slots__ = ("layer", "q", "k", "weights", "topk_idxs", "attn_target", "dense_target",
                 "ratio", "start_pos", "positions", "n_heads", "target", "clip")

    def __init__(self, layer, q, k, weights, topk_idxs, ratio, start_pos, positions=None,
                 n_heads=1, target="selected", clip=None):
        self.layer, self.q, self.k, self.weights = layer, q, k, weights
        self.topk_idxs, self.ratio, self.start_pos = topk_idxs, ratio, start_pos
        self.positions, self.n_heads = positions, n_heads
        self.target, self.clip = target, clip
        self.attn_target = self.dense_target = None

    def loss(self, dense=False, *, target=None, clip=None, return_metrics=False):
        """``deepseek_csa.torch.indexer_kl_loss`` of this layer: the sparse stage (the
        selected set), or with ``dense=True`` the warm-up over every visible entry.
        ``target`` / ``clip`` default to the capture's; ``target="joint"`` passes the
        recorded head sums divided by ``n_heads`` (the joint attention probabilities)."""
        dct = _att._dct()
        target = self.target if target is None else target
        clip = self.clip if clip is None else clip
        if dense:
            if self.dense_target is None:
                raise RuntimeError("IndexerRecord.loss(dense=True) needs "
                                   "capture_indexer(model, dense=True)")
            idx, tgt = None, self.dense_target
        else:
            idx, tgt = self.topk_idxs, self.attn_target
        if target == "joint":
            tgt = tgt / self.n_heads
        kw = dict(return_metrics=True) if return_metrics else {}
        return dct.indexer_kl_loss(self.q, self.k, self.weights, idx, tgt, ratio=self.ratio,
                                   start_pos=self.start_pos, positions=self.positions,
                                   target=target, clip=clip, **kw)


class IndexerCapture:
    """Handed out by ``capture_indexer``: ``layers`` (one ``IndexerRecord`` per swapped
    CSA layer that had compressed entries in the last forward, in layer order) and
    ``loss()`` (the sum of their KL losses)."""

    def __init__(self, dense=False, target="selected", clip=None):
        if target not in ("selected", "joint"):
            raise ValueError(f"capture_indexer(): 'target' must be 'selected' or 'joint', "
                             f"got {target!r}")
        self.dense = bool(dense)
        self.target, self.clip = target, clip
        self._layers = {}

    @property
    def layers(self):
        return [self._layers[i] for i in sorted(self._layers)]

    def loss(self, dense=None):
        """Sum over the recorded layers of ``indexer_kl_loss`` (``dense`` defaults to the
        capture's own setting; the target and clip are the capture's)."""
        dense = self.dense if dense is None else bool(dense)
        recs = self.layers
        if not recs:
            raise RuntimeError("capture_indexer: no CSA layer with compressed entries ran "
                               "in the captured forward")
        total = recs[0].loss(dense)
        for r in recs[1:]:
            total = total + r.loss(dense)
        return total

    def metrics(self, dense=None):
        """Per recorded layer, ``IndexerKLMetrics`` (kl, kl_uniform, kl_captured, rows,
        degenerate_rows; no gradient) of its loss: one more pass of the kernel each."""
        dense = self.dense if dense is None else bool(dense)
        return [r.loss(dense, return_metrics=True)[1] for r in self.layers]

    def clear(self):
        self._layers = {}


@contextlib.contextmanager
def capture_indexer(model, *, dense: bool = False, target: str = "selected", clip=None):
    """``with capture_indexer(model) as cap: model(ids); loss = cap.loss()``.

    Every swapped CSA layer records, per forward (the last one wins), its indexer's
    q / k / weights -- computed through the differentiable ops from its inputs *detached*
    from the main graph, so ``cap.loss().backward()`` reaches only the indexers'
    parameters (as DeepSeek trains the indexer: it learns only from its KL loss, the
    model only from the LM loss) -- the selected indices and their attention target
    (``sparse_attn_weights``, no grad).  ``dense=True`` also records the warm-up target
    over every visible entry (``cap.loss()`` then is the dense KL).  ``target`` and
    ``clip`` are ``indexer_kl_loss``'s, for every record's ``loss()`` ("joint": the
    recorded head sums over ``n_heads``, docs/kernels.md section 11.3).  Padded batches
    (a 2-D attention mask with zeros) and position ids per row are recorded with each
    query's position; pad queries take no part, so each row's terms are those of the row
    run alone.  The model is swapped for the block if it was not.  Grad mode is the
    caller's: freeze the rest of the model (``requires_grad_(False)``) and the main path
    runs on the inference kernels."""
    from .swap import _ATTR, _base, is_swapped, swap, unswap
    missing = _att._missing_grad_ops(_att._GRAD_ALL)
    if missing:
        raise RuntimeError(f"capture_indexer needs the differentiable ops of "
                           f"deepseek_csa.torch ({', '.join(missing)} missing in this build)")
    cap = IndexerCapture(dense, target, None if clip is None else float(clip))
    base = _base(model)
    own = not is_swapped(model)
    if own:
        swap(model)
    st = getattr(base, _ATTR)
    if st.capture is not None:
        if own:
            unswap(model)
        raise RuntimeError("capture_indexer: this model is already being captured")
    st.capture = cap
    try:
        yield cap
    finally:
        st.capture = None
        if own:
            unswap(model)
