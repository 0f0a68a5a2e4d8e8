"""The Compressor: gated pooling of KV groups (docs/kernels.md, section 3), for prefill
and decode.

``gated_pool`` pools the complete groups of a prefill.  ``Compressor`` adds the
explicit per-sequence streaming state of decode and the optional epilogue of the
released module (cast to the model dtype, RMSNorm, RoPE at ``g * ratio``, then a
quantization hook).  All arithmetic runs in C (``deepseek_csa._core``).

Equivalence with the released ``Compressor``: the released module keeps the
open group (and, with overlap, the previous group) in buffers that it never
clears, so a new sequence can read the leftovers of the previous one in the
group it starts with.  Here the state is explicit and per sequence: a row is
fresh after ``prefill`` (which always starts a sequence at position 0) or
``reset``.  For a single sequence started by a prefill, the entries are those of
the released code; ``prefill(T1)`` followed by decode steps gives bitwise the
entries of ``prefill(T)`` at every split point.

bfloat16: ``kv`` / ``score`` may be bfloat16 (ml_dtypes.bfloat16 arrays, torch
bfloat16 tensors, read in place).  They are widened exactly, the arithmetic and the
streaming state stay float32, and the entries come back in bfloat16 at the released
rounding points: the pooled entry is rounded once (the cast to the model dtype), the
RMSNorm and RoPE round on their stores, the named QAT roundings compute in float32
and round once at the end.  The streaming law holds bitwise for bfloat16 too.
"""
from __future__ import annotations

import operator
from typing import Callable, Optional, Sequence, Union

import numpy as np

from ._core import (_pool_prefill, _pool_state, _pool_step, _round_bf16, fp4_round, fp8_round,
                    gated_pool, gated_pool_backward, hadamard)

__all__ = ["gated_pool", "gated_pool_backward", "Compressor"]


def _quant_fn(name, rope_dim, bf16):
    """The released model's QAT rounding of emitted entries, by name (kernels.md section 7)."""
    def fp8(y):     # V4 compressed KV: FP8 on the features in front of the rope tail
        fp8_round(y[..., :y.shape[-1] - rope_dim], 64)

    def fp4(y):     # FP4, power-of-two scales
        fp4_round(y, 32)

    # A bfloat16 y (bfloat16 inputs) is rounded back to bfloat16 by each call itself.
    def hadamard_fp4(y):   # V4 indexer keys: rotate, (back to the model dtype), FP4
        hadamard(y, out=y)
        if bf16 and y.dtype == np.float32:
            _round_bf16(y)
        fp4_round(y, 32)

    def fp4_e4m3(y):       # V4.1 compressed KV: FP4 in blocks of 16 with e4m3 scales
        fp4_round(y, 16, scale="e4m3")
        if bf16 and y.dtype == np.float32:   # e4m3 scales are not powers of two: back
            _round_bf16(y)                   # to the model dtype

    return {"fp8": fp8, "fp4": fp4, "hadamard_fp4": hadamard_fp4, "fp4_e4m3": fp4_e4m3}[name]


_QUANT_NAMES = ("fp8", "fp4", "hadamard_fp4", "fp4_e4m3")
# The C epilogue's codes of the named roundings (enum csa_pool_quant in csrc/pool.h);
# _quant_fn above is the same rounding by separate calls, kept as the tests' oracle.
_QUANT_CODES = {"fp8": 1, "fp4": 2, "hadamard_fp4": 3, "fp4_e4m3": 4}


def _view(x):
    """A torch tensor as a NumPy view (Tensor.numpy() costs a fraction of the
    __array__ path the C glue would otherwise take: it matters at a few microseconds
    per decode step); anything else, or a tensor NumPy cannot view (bf16, on GPU,
    requiring grad), is passed on for the C glue to accept or reject."""
    if x is None or type(x) is np.ndarray:
        return x
    try:
        return x.numpy()
    except Exception:
        return x


def _f32(x, name, shape, what):
    """A C-contiguous float32 copy of an argument, checked against `shape` (None = any)."""
    try:
        a = np.asarray(_view(x))
    except Exception:
        raise TypeError(f"Compressor(): '{name}' must be a float32 array, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}") from None
    if a.dtype != np.float32:
        raise TypeError(f"Compressor(): '{name}' must be a float32 array, got dtype {a.dtype}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"Compressor(): '{name}' must have shape {list(shape)} ({what}), "
                         f"got {list(a.shape)}")
    return np.array(a, dtype=np.float32, order="C", copy=True)


class Compressor:
    """Streaming gated pooling for ``batch`` sequences (rows), one state per row.

    Compressor(batch, ratio, head_dim, *, overlap=False, ape=None,
               norm_weight=None, eps=1e-6, rope=None, model_dtype="float32", quant=None,
               packed=False)

    batch       : rows of state; calls may use the first B <= batch rows.
    ratio       : tokens per entry, >= 1 (V4: 4 with overlap, 128; V4.1: 2, 1).
    head_dim    : D, the entry width.  Inputs have c*D features, c = 2 with overlap.
    overlap     : V4's ratio-4 scheme (2*ratio candidates per entry, kernels.md section 3).
    ape         : float32 [ratio, c*D] added to the scores (None: zeros, V4.1).
    Epilogue, applied to each emitted entry in the released order:
    model_dtype : "float32" or "bfloat16", for float32 inputs: with bfloat16 the
                  pooled entry is rounded to bfloat16 (the released cast to the model
                  dtype), and so is the result of the norm and of RoPE (each writes
                  the model dtype); the entries are float32 arrays either way.
                  bfloat16 kv inputs always run the bfloat16 epilogue (their model
                  dtype is bfloat16) and return bfloat16 entries.
    norm_weight : float32 [D], the compressor's RMSNorm weight (None: no norm); eps.
    rope        : (cos, sin) float32 [P, Dr/2] tables (``rope_table``; None: no
                  RoPE, as V4.1 which rotates outside the compressor): entry g is
                  rotated on its last Dr features at position g*ratio < P.
    quant       : the released QAT rounding applied last to every emitted entry:
                  "fp8"  FP8 e4m3, ue8m0 scales, blocks of 64 over the first D - Dr
                         features (V4 compressed KV; Dr from `rope`, else 64),
                  "hadamard_fp4"  Hadamard rotation then FP4 e2m1 in blocks of 32
                         (V4 indexer keys),
                  "fp4"  FP4 e2m1, ue8m0 scales, blocks of 32,
                  "fp4_e4m3"  FP4 in blocks of 16 with e4m3 scales (V4.1 KV),
                  or a callable ``quant(entries) -> array or None`` given every
                  emitted [B, n, D] array, float32 or (bfloat16 inputs) bfloat16
                  (None result: rounded in place).  The named roundings run inside
                  the C epilogue (one C call per prefill / step); a callable runs in
                  Python on the returned entries.
    packed      : False, or True with quant "fp4" or "hadamard_fp4" (head_dim a
                  multiple of 32): prefill / step return the entries as uint8
                  [B, n, head_dim // 2 + head_dim // 32], the e2m1 codes of the
                  rounded values two a byte (element 2i in the low nibble), then one
                  ue8m0 exponent byte per block of 32 features (127 = 2^0); codes
                  times scales are bitwise the entries of packed=False
                  (docs/kernels.md, "Packed FP4 entries").

    Ratio 1 without overlap is V4.1's ungated entry: the token's own kv (score may
    be None), then the epilogue.

    Not thread-safe: one Compressor per thread of decoding.
    """

    def __init__(self, batch: int, ratio: int, head_dim: int, *, overlap: bool = False,
                 ape=None, norm_weight=None, eps: float = 1e-6,
                 rope: Optional[Sequence] = None, model_dtype: str = "float32",
                 quant: Union[None, str, Callable] = None, packed: bool = False):
        batch = self._int("batch", batch, 1)
        ratio = self._int("ratio", ratio, 1)
        head_dim = self._int("head_dim", head_dim, 1)
        overlap = bool(overlap)
        c = 2 if overlap else 1
        ape = None if ape is None else _f32(ape, "ape", (ratio, c * head_dim),
                                            "[ratio, c*head_dim]")
        nw = None if norm_weight is None else _f32(norm_weight, "norm_weight", (head_dim,),
                                                  "[head_dim]")
        if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.floating,
                                                                    np.integer)):
            raise TypeError(f"Compressor(): 'eps' must be a float, got {type(eps).__name__}")
        eps = float(eps)
        if not np.isfinite(eps) or eps < 0:
            raise ValueError(f"Compressor(): 'eps' must be finite and >= 0, got {eps}")
        cos = sin = None
        if rope is not None:
            if not isinstance(rope, (tuple, list)) or len(rope) != 2:
                raise TypeError("Compressor(): 'rope' must be a (cos, sin) pair of tables")
            cos = _f32(rope[0], "rope[0] (cos)", None, "")
            sin = _f32(rope[1], "rope[1] (sin)", cos.shape, "the shape of cos")
            if cos.ndim != 2 or cos.shape[1] < 1 or 2 * cos.shape[1] > head_dim:
                raise ValueError(f"Compressor(): 'rope' tables must be [P, Dr/2] with "
                                 f"Dr <= head_dim={head_dim}, got {list(cos.shape)}")
        if model_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"Compressor(): 'model_dtype' must be 'float32' or 'bfloat16', "
                             f"got {model_dtype!r}")
        qcode, quant_d = 0, 0
        if isinstance(quant, str):
            if quant not in _QUANT_NAMES:
                raise ValueError(f"Compressor(): 'quant' must be None, a callable or one of "
                                 f"{_QUANT_NAMES}, got {quant!r}")
            qcode = _QUANT_CODES[quant]
            rd = 2 * cos.shape[1] if cos is not None else 64
            quant_d = head_dim - rd
            if quant == "fp8" and (quant_d < 0 or quant_d % 64):
                raise ValueError(f"Compressor(): 'quant' 'fp8' rounds the head_dim - {rd} "
                                 f"features in front of the rope tail in blocks of 64, so "
                                 f"head_dim - {rd} must be a multiple of 64 >= 0, got "
                                 f"head_dim={head_dim}")
            if quant in ("fp4", "hadamard_fp4") and head_dim % 32:
                raise ValueError(f"Compressor(): 'quant' {quant!r} rounds blocks of 32, so "
                                 f"head_dim must be a multiple of 32, got {head_dim}")
            if quant == "fp4_e4m3" and head_dim % 16:
                raise ValueError(f"Compressor(): 'quant' 'fp4_e4m3' rounds blocks of 16, so "
                                 f"head_dim must be a multiple of 16, got {head_dim}")
            if quant == "hadamard_fp4" and head_dim & (head_dim - 1):
                raise ValueError(f"Compressor(): 'quant' 'hadamard_fp4' needs a power-of-two "
                                 f"head_dim, got {head_dim}")
            quant_d = max(quant_d, 0)
            quant = None
        if quant is not None and not callable(quant):
            raise TypeError(f"Compressor(): 'quant' must be None or callable, got "
                            f"{type(quant).__name__}")
        if not isinstance(packed, (bool, np.bool_)):
            raise TypeError(f"Compressor(): 'packed' must be a bool, got "
                            f"{type(packed).__name__}")
        packed = bool(packed)
        if packed and qcode not in (_QUANT_CODES["fp4"], _QUANT_CODES["hadamard_fp4"]):
            got = _QUANT_NAMES[qcode - 1] if qcode else quant
            raise ValueError("Compressor(): 'packed' needs quant='fp4' or 'hadamard_fp4' "
                             f"(FP4 codes with ue8m0 scales), got quant={got!r}")
        self.batch, self.ratio, self.head_dim, self.overlap = batch, ratio, head_dim, overlap
        self.model_dtype, self.eps, self.packed = model_dtype, eps, packed
        self._quant = quant
        self._kv = np.zeros((batch, ratio, c * head_dim), np.float32)
        self._score = np.empty_like(self._kv)
        shape_prev = (batch, ratio, head_dim) if overlap else (0,)
        self._prev_kv = np.zeros(shape_prev, np.float32)
        self._prev_score = np.empty(shape_prev, np.float32)
        self._pos = np.zeros(batch, np.int64)
        self.reset()
        # The C state and epilogue (a capsule), validated once here: prefill and step
        # read it (see py_pool.c); it points into the arrays above, which reset() only
        # ever writes in place, and keeps them alive.
        self._cstate = _pool_state(ratio, int(overlap), head_dim, self._kv, self._score,
                                   self._prev_kv, self._prev_score, self._pos, ape, nw, eps,
                                   cos, sin, int(model_dtype == "bfloat16"), qcode, quant_d,
                                   int(packed))

    @staticmethod
    def _int(name, v, lo, hi=1 << 40):
        try:
            if isinstance(v, (bool, np.bool_)):
                raise TypeError
            v = operator.index(v)
        except TypeError:
            raise TypeError(f"Compressor(): '{name}' must be an int, got "
                            f"{type(v).__name__}") from None
        if not lo <= v <= hi:
            raise ValueError(f"Compressor(): '{name}' must be in [{lo}, {hi}], got {v}")
        return v

    @property
    def positions(self) -> np.ndarray:
        """Per row, the tokens seen so far = the ``start_pos`` its next step must have."""
        return self._pos.copy()

    def reset(self, rows=None):
        """Makes rows fresh (position 0), all of them by default; ``rows`` is anything
        that indexes axis 0 (an int, a slice, a list, a mask)."""
        sel = slice(None) if rows is None else rows
        self._kv[sel] = 0.0
        self._score[sel] = -np.inf
        if self.overlap:
            self._prev_kv[sel] = 0.0
            self._prev_score[sel] = -np.inf
        self._pos[sel] = 0

    def prefill(self, kv, score=None, *, out=None) -> np.ndarray:
        """Starts a sequence in rows 0..B-1 at position 0.

        kv, score : float32 or bfloat16 [B, T, c*head_dim], B <= batch, any strides
                    (they may differ in dtype: each is widened exactly).
        out       : [B, T // ratio, head_dim] of kv's dtype, C-contiguous, or None
                    (packed: uint8 [B, T // ratio, head_dim // 2 + head_dim // 32]).
        Returns the T // ratio complete entries [B, T // ratio, head_dim] (after the
        epilogue); keeps the T % ratio trailing tokens (and, with overlap, the last
        complete group) for ``step``.  Rows >= B are left as they are.  The entries
        have kv's dtype (bfloat16 kv: bfloat16 entries, see the module docstring), or
        are packed FP4 rows (``packed=True``).
        """
        y = _pool_prefill(self._cstate, _view(kv), _view(score), out)
        if self._quant is not None and y.shape[1]:
            y = self._apply_quant(y)
        return y

    def step(self, kv, score, start_pos: int):
        """One decode token per row at position ``start_pos`` (which must be every
        used row's ``positions``); kv, score: float32 or bfloat16 [B, 1, c*head_dim],
        B <= batch.  Returns the new entry [B, 1, head_dim] of kv's dtype (compressed
        index start_pos // ratio; packed: uint8 [B, 1, head_dim // 2 + head_dim // 32])
        when the token completes its group, else None."""
        y = _pool_step(self._cstate, _view(kv), _view(score), start_pos)
        if y is not None and self._quant is not None:
            y = self._apply_quant(y)
        return y

    def _apply_quant(self, y):
        r = self._quant(y)
        return y if r is None else r

    def __repr__(self):
        return (f"Compressor(batch={self.batch}, ratio={self.ratio}, head_dim={self.head_dim}, "
                f"overlap={self.overlap}, model_dtype={self.model_dtype!r}, "
                f"{'packed=True, ' if self.packed else ''}"
                f"positions={self._pos.tolist() if self.batch <= 8 else '...'})")
