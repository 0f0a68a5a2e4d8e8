"""Float32 torch reference of the Compressor, written from docs/kernels.md, section 3.

`pool` is the prefill pooling of complete groups; `RefCompressor` is the whole
module as released: its decode branch keeps the open group (and, with overlap, the
previous group) in buffers, and its epilogue casts to the model dtype, RMSNorms and
rotates the entry at position g*ratio.
"""
import torch

from . import norm_rope as ref_norm_rope

NEG_INF = float("-inf")


def pool(kv, score, ratio, ape=None, overlap=False):
    """kv, score [B, T, c*D] -> [B, T // ratio, D]: per feature, softmax over the
    candidates of an entry of (score + ape), weighting kv; float32."""
    kv, score = kv.float(), (None if score is None else score.float())
    B, T, cd = kv.shape
    G = T // ratio
    if ratio == 1 and not overlap:          # V4.1 ratio 1: no gate, the token's own kv
        return kv[:, :G].clone()
    k = kv[:, :G * ratio].unflatten(1, (G, ratio))        # [B, G, r, cd]
    s = score[:, :G * ratio].unflatten(1, (G, ratio))
    if ape is not None:
        s = s + ape.float()
    if overlap:
        d = cd // 2
        # candidates 0..r-1: group g-1 through features [0, d); r..2r-1: group g through [d, 2d)
        kk = k.new_zeros(B, G, 2 * ratio, d)
        ss = s.new_full((B, G, 2 * ratio, d), NEG_INF)
        kk[:, :, ratio:] = k[..., d:]
        ss[:, :, ratio:] = s[..., d:]
        kk[:, 1:, :ratio] = k[:, :-1, :, :d]
        ss[:, 1:, :ratio] = s[:, :-1, :, :d]
        k, s = kk, ss
    return (k * s.softmax(dim=2)).sum(dim=2)


class RefCompressor:
    """The released module's behaviour, with its state, on float32 kv / score.

    dtype: the model dtype of the epilogue (torch.float32 or torch.bfloat16).
    Returns float32 entries (the epilogue's output converted back) or None."""

    def __init__(self, batch, ratio, d, overlap=False, ape=None, norm_w=None, eps=1e-6,
                 cos=None, sin=None, dtype=torch.float32):
        self.ratio, self.d, self.overlap = ratio, d, overlap
        c = 2 if overlap else 1
        self.ape = ape
        self.norm_w, self.eps, self.cos, self.sin, self.dtype = norm_w, eps, cos, sin, dtype
        self.kv = torch.zeros(batch, ratio, c * d)
        self.sc = torch.full((batch, ratio, c * d), NEG_INF)
        self.pkv = torch.zeros(batch, ratio, d)
        self.psc = torch.full((batch, ratio, d), NEG_INF)

    def epilogue(self, x, g0):
        x = x.to(self.dtype)
        if self.norm_w is not None:
            x = ref_norm_rope.rms_norm(x, self.norm_w, self.eps)
        if self.cos is not None:
            r, n = self.ratio, x.shape[1]
            rows = torch.arange(g0, g0 + n) * r
            x = ref_norm_rope.apply_rope(x, self.cos[rows], self.sin[rows])
        return x.float()

    def __call__(self, kv, score, start_pos):
        r, d = self.ratio, self.d
        B, T, _ = kv.shape
        gate = r > 1 or self.overlap
        if start_pos == 0:
            out = pool(kv, score, r, self.ape, self.overlap)
            G, rem = T // r, T % r
            if gate:
                lg = score.float()[:, G * r:]
                if self.ape is not None:
                    lg = lg + self.ape[:rem]
                self.kv[:B, :rem] = kv[:, G * r:]
                self.sc[:B, :rem] = lg
                if self.overlap and G > 0:
                    lp = score.float()[:, (G - 1) * r:G * r, :d]
                    if self.ape is not None:
                        lp = lp + self.ape[:, :d]
                    self.pkv[:B] = kv[:, (G - 1) * r:G * r, :d]
                    self.psc[:B] = lp
            return self.epilogue(out, 0) if G > 0 else None
        assert T == 1
        slot, g = start_pos % r, start_pos // r
        if not gate:
            return self.epilogue(kv.float(), g)
        lg = score.float()[:, 0]
        if self.ape is not None:
            lg = lg + self.ape[slot]
        self.kv[:B, slot] = kv[:, 0]
        self.sc[:B, slot] = lg
        if (start_pos + 1) % r:
            return None
        if self.overlap:
            k = torch.cat([self.pkv[:B], self.kv[:B, :, d:]], dim=1)
            s = torch.cat([self.psc[:B], self.sc[:B, :, d:]], dim=1)
            self.pkv[:B] = self.kv[:B, :, :d]
            self.psc[:B] = self.sc[:B, :, :d]
        else:
            k, s = self.kv[:B], self.sc[:B]
        out = (k * s.softmax(dim=1)).sum(dim=1, keepdim=True)
        return self.epilogue(out, g)
