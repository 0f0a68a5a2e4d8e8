"""One DeepSeek-V4 / V4.1 attention layer in NumPy, with everything but the dense
projections running through deepseek_csa's C kernels.

    layer = CSALayer(weights, V4_FLASH, ratio=4, batch=1, max_seq_len=8192)
    y = layer(x, 0)            # prefill: x float32 [B, S, dim]
    y = layer(x1, S)           # decode: one token per row, start_pos = S, S+1, ...

``weights`` maps the released checkpoint's attention tensor names to float32 arrays
(already dequantized: FP8 checkpoint weights must be multiplied out with their block
scales first).  Names are relative to the attention module; any prefix ending in
``attn.`` (``layers.3.attn.wq_a.weight``) is stripped.  A V4 layer uses

    wq_a.weight [q_lora, dim]       q_norm.weight [q_lora]     wq_b.weight [H*D, q_lora]
    wkv.weight [D, dim]             kv_norm.weight [D]         attn_sink [H]
    wo_a.weight [G*o_lora, H*D/G]   wo_b.weight [dim, G*o_lora]
    ratio > 0:  compressor.{wkv,wgate}.weight [c*D, dim], compressor.ape [r, c*D],
                compressor.norm.weight [D]
    ratio 4:    indexer.wq_b.weight [Hi*Di, q_lora], indexer.weights_proj.weight [Hi, dim],
                indexer.compressor.{wkv,wgate,ape,norm.weight} (Di wide, overlap)

and a layer of V4.1's shared layout (``cfg.kv_source_layers`` set, e.g. ``V41_FLASH``)
reads ``compressor.{wkv,wgate,norm}`` (kv sources, no ``ape``, no ``wgate`` at ratio 1)
and ``indexer.{wq_b,weights_proj,wk,k_norm}`` (index sources; ``wk``/``k_norm`` on kv
sources), sharing what its sources publish through a ``CSAShared`` object passed to
every layer of the stack.

Every V4 / V4.1 difference in the arithmetic comes from an explicit ``CSAConfig`` field
(``q_head_rms_norm``, ``window_fp8_block`` / ``window_fp8_rope``,
``compressed_kv_quant``, ``index_hadamard``, ``index_order``; see
``deepseek_csa.configs``), never from a version guess.

Caches (per layer, explicit, fresh at ``start_pos == 0``): the window ring and the
compressed cache live in one buffer ``[B, window + max_seq_len//r, D]`` (ring first,
as the attention reads them, so a decode step attends without copying), the indexer's
keys in ``[B, max_seq_len//r, Di]``, and the compressor streaming state in
``deepseek_csa.Compressor`` objects.

Differences from the released module, on purpose: the state is reset by every prefill
(the released compressor keeps leftovers of the previous sequence), prefill must start
at position 0 and decode takes one token per row (the released code has the same
contract), and everything runs in float32 (the released model keeps activations in
bfloat16 between ops).  V4.1: by default (``cfg.index_key_publish == "every_call"``) an
index-key owner republishes its key cache on every call; the released indexer
republishes it only on calls where the layer's compressor emits an entry, so on decode
steps where a ratio-2 group is still filling, the released ratio-2 index layers score
their queries against the keys of whichever owner published last (in V4.1-Flash: layer
20's ratio-1 keys), and such a step differs from the prefill of the same tokens.
``index_key_publish="on_entry"`` gives the released behaviour; ``deepseek_csa.torch.swap``
reproduces it inside a released model.
V4.1 candidate blocks holding fewer entries than ``index_topk`` (never the case in the
released configuration: 2048 blocks of 8 against a top-512): the released code still
takes ``index_topk`` entries, some from outside the kept blocks (-inf scores); this layer
pads those rows with -1.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

import deepseek_csa as _dc
from .configs import CSAConfig, V4_FLASH

__all__ = ["CSALayer", "CSAShared", "layer_weight_shapes", "random_layer_weights"]

_PROJ = "projections"
_CONTROLLER = []   # threadpoolctl.ThreadpoolController, made on first use (it scans libraries)


def _blas_limit(n):
    """Context limiting the BLAS pool to n threads (threadpoolctl), or a no-op without it."""
    import contextlib
    if n is None:
        return contextlib.nullcontext()
    if not _CONTROLLER:
        try:
            from threadpoolctl import ThreadpoolController
            _CONTROLLER.append(ThreadpoolController())
        except ImportError:
            _CONTROLLER.append(None)
    ctl = _CONTROLLER[0]
    return contextlib.nullcontext() if ctl is None else ctl.limit(limits=n, user_api="blas")


def _hadamard_only(e):
    """The indexer keys' epilogue with the QAT rounding off: the rotation alone."""
    _dc.hadamard(e, out=e)


def _entry_quant(cfg: CSAConfig, qat: bool):
    """The Compressor epilogue's QAT rounding of V4-layout compressed KV entries."""
    return cfg.compressed_kv_quant if qat else None


def _index_key_quant(cfg: CSAConfig, qat: bool):
    """The Compressor epilogue of V4-layout indexer keys: [Hadamard] then FP4."""
    if cfg.index_hadamard:
        return "hadamard_fp4" if qat else _hadamard_only
    return "fp4" if qat else None


def _clean_name(k: str) -> str:
    i = k.rfind("attn.")
    return k[i + 5:] if i >= 0 else k


@dataclass
class CSAShared:
    """What V4.1 kv / index sources publish for the layers that read them (one per stack)."""
    compress_kv: Optional[np.ndarray] = None   # [B, max_seq_len//r, D], rotated + FP4
    n_compressed: int = 0
    index_k: Optional[np.ndarray] = None       # [B, max_seq_len//r, Di]
    topk_idxs: Optional[np.ndarray] = None     # int32 [B, S, k] of the last index source
    candidates: object = None                  # candidate-block mask of the candidate source


def _layout(cfg: CSAConfig, version: Optional[str], who: str) -> str:
    """'v4' (each layer its own) or 'v4.1' (shared sources), from cfg.kv_source_layers; a
    ``version`` given as well must agree with it."""
    layout = "v4.1" if cfg.shared_sources else "v4"
    if version is not None:
        if version not in ("v4", "v4.1"):
            raise ValueError(f"{who}: 'version' must be 'v4' or 'v4.1', got {version!r}")
        if version != layout:
            raise ValueError(f"{who}: 'version' {version!r} contradicts the config "
                             f"{cfg.name!r}, whose kv_source_layers={cfg.kv_source_layers!r} "
                             f"make it the {layout!r} layout")
    return layout


def layer_weight_shapes(cfg: CSAConfig, ratio: int, *, version: Optional[str] = None,
                        kv_source: bool = True, index_source: bool = True) -> Dict[str, tuple]:
    """Names and shapes of the attention tensors one layer reads (the layout, V4's or
    V4.1's, comes from ``cfg.kv_source_layers``; ``version`` may say it too)."""
    version = _layout(cfg, version, "layer_weight_shapes")
    D, H, G = cfg.head_dim, cfg.n_heads, cfg.o_groups
    Hi, Di = cfg.index_heads, cfg.index_head_dim
    s = {"wq_a.weight": (cfg.q_lora_rank, cfg.dim), "q_norm.weight": (cfg.q_lora_rank,),
         "wq_b.weight": (H * D, cfg.q_lora_rank), "wkv.weight": (D, cfg.dim),
         "kv_norm.weight": (D,), "attn_sink": (H,),
         "wo_a.weight": (G * cfg.o_lora_rank, H * D // G),
         "wo_b.weight": (cfg.dim, G * cfg.o_lora_rank)}
    if not ratio:
        return s
    if version == "v4":
        c = 2 if ratio == 4 else 1
        s.update({"compressor.wkv.weight": (c * D, cfg.dim),
                  "compressor.wgate.weight": (c * D, cfg.dim),
                  "compressor.ape": (ratio, c * D), "compressor.norm.weight": (D,)})
        if ratio == 4:
            s.update({"indexer.wq_b.weight": (Hi * Di, cfg.q_lora_rank),
                      "indexer.weights_proj.weight": (Hi, cfg.dim),
                      "indexer.compressor.wkv.weight": (2 * Di, cfg.dim),
                      "indexer.compressor.wgate.weight": (2 * Di, cfg.dim),
                      "indexer.compressor.ape": (ratio, 2 * Di),
                      "indexer.compressor.norm.weight": (Di,)})
        return s
    if kv_source:
        s.update({"compressor.wkv.weight": (D, cfg.dim), "compressor.norm.weight": (D,)})
        if ratio > 1:
            s["compressor.wgate.weight"] = (D, cfg.dim)
    if index_source:
        s.update({"indexer.wq_b.weight": (Hi * Di, cfg.q_lora_rank),
                  "indexer.weights_proj.weight": (Hi, cfg.dim)})
        if kv_source:
            s.update({"indexer.wk.weight": (Di, D), "indexer.k_norm.weight": (Di,)})
    return s


def random_layer_weights(cfg: CSAConfig, ratio: int, *, seed: int = 0, **kw) -> Dict[str, np.ndarray]:
    """Random float32 weights: projections N(0, 1/fan_in), norms ~1, sinks and ape N(0, 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shp in layer_weight_shapes(cfg, ratio, **kw).items():
        if name.endswith("norm.weight"):
            a = 1 + 0.1 * rng.standard_normal(shp, dtype=np.float32)
        elif len(shp) == 2 and not name.endswith("ape"):
            a = rng.standard_normal(shp, dtype=np.float32) * np.float32(shp[1] ** -0.5)
        else:
            a = rng.standard_normal(shp, dtype=np.float32)
        out[name] = a
    return out


class CSALayer:
    """One attention layer: prefill (``start_pos == 0``, any S) and one-token decode.

    cfg        : a CSAConfig (``deepseek_csa.V4_FLASH`` ...) for the shapes, eps, RoPE.
    ratio      : compress ratio of this layer, or ``layer_id`` to read it from cfg.
    version    : optional, "v4" or "v4.1": must agree with the layout that
                 ``cfg.kv_source_layers`` implies (None: V4's, every layer its own;
                 a tuple: V4.1's shared sources).  The arithmetic differences come from
                 cfg's explicit fields (q_head_rms_norm, window_fp8_*, ...).
    V4.1 roles : kv_source (pools its own compressed KV), index_source (runs an indexer),
                 candidate_source / uses_candidates with candidate_topk_blocks and
                 candidate_block_size; ``shared`` (CSAShared) links the stack's layers.
                 Given ``layer_id``, each role left as None comes from cfg
                 (kv_source_layers, index_source_layers, candidate_source_layer: the
                 index layers after the candidate source score within its blocks).
    index_topk : defaults to cfg.index_topk.
    decode_blas_threads : BLAS threads for the projections of decode-sized calls
                 (B*S <= 16; None, the default, leaves BLAS alone).  Those GEMVs are
                 memory-bound and want every core on an idle machine (2 cores, V4-Flash
                 decode step after 512 tokens: 32 ms with BLAS's own threads, 48 ms at 1),
                 but when other work shares the cores a BLAS pool spinning after each
                 call takes the cores the kernels' OpenMP threads need next, and 1 is
                 better (349 -> 219 ms on a loaded machine).  Needs threadpoolctl.
    qat        : False skips the FP8/FP4 quantization-aware rounding (the Hadamard rotation
                 stays), to study what the rounding does or to compare with a reference
                 without its discontinuities.

    After each call ``last_topk`` holds the compressed part of the index lists (int32,
    -1 for nothing) and ``timings`` accumulates seconds per op (``reset_timings()``).
    """

    def __init__(self, weights, cfg: CSAConfig = V4_FLASH, *, ratio: Optional[int] = None,
                 layer_id: Optional[int] = None, version: Optional[str] = None, batch: int = 1,
                 max_seq_len: int = 8192, index_topk: Optional[int] = None,
                 kv_source: Optional[bool] = None, index_source: Optional[bool] = None,
                 candidate_source: Optional[bool] = None,
                 uses_candidates: Optional[bool] = None,
                 candidate_topk_blocks: int = 0, candidate_block_size: int = 0,
                 shared: Optional[CSAShared] = None, qat: bool = True,
                 decode_blas_threads: Optional[int] = None):
        if ratio is None:
            if layer_id is None:
                raise ValueError("CSALayer: give 'ratio' or 'layer_id'")
            ratio = cfg.compress_ratios[layer_id]
        version = _layout(cfg, version, "CSALayer")
        if int(ratio) < 0:
            raise ValueError(f"CSALayer: 'ratio' must be >= 0, got {ratio}")
        self.cfg, self.ratio, self.version = cfg, int(ratio), version
        self.layer_id = layer_id
        self.batch, self.max_seq_len = int(batch), int(max_seq_len)
        self.index_topk = int(index_topk or cfg.index_topk)
        v41 = version == "v4.1"
        if v41 and ratio:
            if kv_source is None:
                kv_source = layer_id is not None and layer_id in (cfg.kv_source_layers or ())
            if index_source is None:
                index_source = (layer_id in cfg.index_source_layers
                                if layer_id is not None and cfg.index_source_layers is not None
                                else bool(kv_source))
            cand = cfg.candidate_source_layer if layer_id is not None else None
            if candidate_source is None:
                candidate_source = cand is not None and index_source and layer_id == cand
            if uses_candidates is None:
                uses_candidates = cand is not None and index_source and layer_id > cand
            if candidate_source or uses_candidates:
                candidate_topk_blocks = candidate_topk_blocks or cfg.candidate_topk_blocks
                candidate_block_size = candidate_block_size or cfg.candidate_block_size
            if shared is None:
                if not kv_source:
                    raise ValueError("CSALayer: a V4.1 reader layer needs the stack's 'shared'")
                shared = CSAShared()
        self.kv_source, self.index_source = bool(kv_source), bool(index_source)
        self.candidate_source, self.uses_candidates = bool(candidate_source), bool(uses_candidates)
        self.candidate_topk_blocks = candidate_topk_blocks
        self.candidate_block_size = candidate_block_size
        self.shared = shared
        self.qat = bool(qat)
        self.decode_blas_threads = decode_blas_threads

        want = layer_weight_shapes(cfg, ratio, version=version,
                                   kv_source=self.kv_source, index_source=self.index_source)
        w = {_clean_name(k): v for k, v in weights.items()}
        self.w = {}
        for name, shp in want.items():
            if name not in w:
                raise KeyError(f"CSALayer: weight '{name}' {shp} missing")
            a = np.ascontiguousarray(np.asarray(w[name], dtype=np.float32))
            if a.shape != shp:
                raise ValueError(f"CSALayer: weight '{name}' must have shape {shp}, got {a.shape}")
            self.w[name] = a
        W = self.w
        G, D = cfg.o_groups, cfg.head_dim
        self._wo_a = W["wo_a.weight"].reshape(G, cfg.o_lora_rank, -1).transpose(0, 2, 1)
        self._cos, self._sin = _dc.rope_table(cfg.rope_dim, self.max_seq_len,
                                              **cfg.rope_kwargs(self.ratio))
        r = self.ratio
        self.n_comp_max = self.max_seq_len // r if r else 0
        own_cache = r and (not v41 or self.kv_source)
        # ring + own compressed cache, in the order the attention reads them
        self._kv = np.zeros((batch, cfg.window + (self.n_comp_max if own_cache else 0), D),
                            np.float32)
        self._ik = None
        # With QAT the index keys are on the FP4 grid: the cache holds them as FP4 rows
        # (docs/kernels.md, section 4: Di/2 + Di/32 bytes a key, 68 at Di = 128) and the
        # indexer scores them from that format.
        self.index_fp4 = bool(self.qat and cfg.index_head_dim % 32 == 0)
        if r and ((not v41 and r == 4) or (v41 and self.kv_source and self.index_source)):
            Di = cfg.index_head_dim
            self._ik = (np.zeros((batch, self.n_comp_max, Di // 2 + Di // 32), np.uint8)
                        if self.index_fp4 else
                        np.zeros((batch, self.n_comp_max, Di), np.float32))
        self.timings: Dict[str, float] = {}
        self.last_topk = None
        self._pos = 0
        self._new_state()

    # ------------------------------------------------------------------ state
    def _new_state(self):
        """Compressors with the released epilogue fused: RMSNorm, RoPE at g*ratio (V4; V4.1
        rotates after its indexer has read the latent) and the QAT rounding."""
        r, cfg, W = self.ratio, self.cfg, self.w
        self._comp = self._icomp = None
        if not r:
            return
        eps, rope = cfg.norm_eps, (self._cos, self._sin)
        if self.version == "v4":
            self._comp = _dc.Compressor(
                self.batch, r, cfg.head_dim, overlap=r == 4, ape=W["compressor.ape"],
                norm_weight=W["compressor.norm.weight"], eps=eps, rope=rope,
                quant=_entry_quant(cfg, self.qat))
            if r == 4:
                # with FP4 keys the epilogue writes the cache's packed rows itself: the
                # rounded float keys never exist
                iquant = _index_key_quant(cfg, self.qat)
                self._icomp = _dc.Compressor(
                    self.batch, r, cfg.index_head_dim, overlap=True,
                    ape=W["indexer.compressor.ape"],
                    norm_weight=W["indexer.compressor.norm.weight"], eps=eps, rope=rope,
                    quant=iquant,
                    packed=self.index_fp4 and iquant in ("fp4", "hadamard_fp4"))
        elif self.kv_source:
            self._comp = _dc.Compressor(self.batch, r, cfg.head_dim,
                                        norm_weight=W["compressor.norm.weight"], eps=eps)

    def cache_bytes(self):
        """Bytes of this layer's caches: {'kv': window ring + compressed KV, 'index_keys':
        the indexer's key cache (FP4 rows when QAT is on), 'total'}."""
        kv = int(self._kv.nbytes)
        ik = int(self._ik.nbytes) if self._ik is not None else 0
        return {"kv": kv, "index_keys": ik, "total": kv + ik}

    def _store_index_keys(self, rows, B, first):
        """Index keys into the cache from `first`: float32 [B, n, Di] (QAT-rounded when
        index_fp4) or, from a packed Compressor, FP4 rows uint8 [B, n, Di//2 + Di//32]."""
        dst = self._ik[:B, first:first + rows.shape[1]]
        if rows.dtype == np.uint8:
            dst[...] = rows
        elif self.index_fp4:
            _dc.fp4_pack(rows, out=dst)   # already on the grid: packing is exact
        else:
            dst[...] = rows

    def reset(self):
        """Forgets the sequence (a prefill does this by itself)."""
        for c in (self._comp, self._icomp):
            if c is not None:
                c.reset()
        self._pos = 0

    def reset_timings(self):
        self.timings = {}

    def fill_synthetic(self, n_tokens: int, *, seed: int = 0, rows: Optional[int] = None,
                       chunk: int = 1 << 16):
        """Puts rows 0..rows-1 (default: all) at position ``n_tokens`` as if that many
        tokens had been prefilled, without running a prefill: the window ring (its last
        ``min(n_tokens, window)`` slots), the ``n_tokens // ratio`` compressed entries,
        the index keys and each compressor's open group get random values, each rounded
        to its QAT grid as the forward pass would leave it (window KV and V4 entries
        FP8, index keys [Hadamard +] FP4 and stored as FP4 rows, V4.1 entries FP4-e4m3;
        no rounding with ``qat=False``).  The next call must be the decode step at
        ``start_pos = n_tokens``.  Meant for measuring long contexts (a 1M-token
        prefill is out of reach on a CPU); the values are Gaussian, scaled by each
        cache's RMSNorm weight, not what a model would write.  Caches are written in
        ``chunk`` entries at a time (bounded scratch).  V4 layout only (V4.1's reader
        layers hold no cache of their own)."""
        if self.version != "v4":
            raise ValueError("CSALayer.fill_synthetic: V4 layout only (cfg.kv_source_layers "
                             "is None); this layer is V4.1's")
        B = self.batch if rows is None else int(rows)
        n_tokens = int(n_tokens)
        if not 1 <= B <= self.batch:
            raise ValueError(f"CSALayer.fill_synthetic: 'rows' must be in 1..{self.batch}, "
                             f"got {rows}")
        if not 0 <= n_tokens < self.max_seq_len:
            raise ValueError(f"CSALayer.fill_synthetic: 'n_tokens' must be in "
                             f"0..{self.max_seq_len - 1} (a decode step follows), got {n_tokens}")
        cfg, W, r = self.cfg, self.w, self.ratio
        D, Dr, win = cfg.head_dim, cfg.rope_dim, cfg.window
        rng = np.random.default_rng(seed)
        self.reset()

        def gauss(n, d, weight):
            x = rng.standard_normal((B, n, d), dtype=np.float32)
            x *= weight
            return x

        # window ring: positions n-keep .. n-1 at slots p % window
        keep = min(n_tokens, win)
        if keep:
            kv = gauss(keep, D, W["kv_norm.weight"])
            self._fp8(kv if cfg.window_fp8_rope else kv[..., :-Dr], cfg.window_fp8_block)
            self._kv[:B, np.arange(n_tokens - keep, n_tokens) % win] = kv
        n = n_tokens // r if r else 0
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            e = gauss(b - a, D, W["compressor.norm.weight"])
            self._round_entries(e)
            self._kv[:B, win + a:win + b] = e
            if self._ik is not None:
                k = gauss(b - a, cfg.index_head_dim, W["indexer.compressor.norm.weight"])
                self._index_rotate_round(k)
                self._store_index_keys(k, B, a)
        # the compressors' streaming state: every slot finite (the slots of tokens still
        # to come are overwritten by them before their group is pooled)
        for c in (self._comp, self._icomp):
            if c is None:
                continue
            for buf in ((c._kv, c._score, c._prev_kv, c._prev_score) if c.overlap
                        else (c._kv, c._score)):
                buf[:B] = rng.standard_normal(buf.shape[1:], dtype=np.float32)
            c._pos[:B] = n_tokens
        self._pos = n_tokens

    def _fp8(self, x, block):
        if self.qat:
            _dc.fp8_round(x, block)

    def _fp4(self, x, block, scale="ue8m0"):
        if self.qat:
            _dc.fp4_round(x, block, scale=scale)

    def _index_rotate_round(self, x):
        """Indexer queries / V4.1 index keys after their RoPE: [Hadamard], FP4 (blocks
        of 32, power-of-two scales).  x is this call's own array, rounded in place."""
        if self.cfg.index_hadamard:
            _dc.hadamard(x, out=x)
        self._fp4(x, 32)

    def _round_entries(self, e):
        """V4.1 layout: the QAT rounding of compressed KV entries after their RoPE."""
        if self.cfg.compressed_kv_quant == "fp4_e4m3":
            self._fp4(e, 16, scale="e4m3")
        else:
            self._fp8(e[..., :-self.cfg.rope_dim], 64)

    def _tick(self, name, t0):
        t1 = time.perf_counter()
        self.timings[name] = self.timings.get(name, 0.0) + (t1 - t0)
        return t1

    # ------------------------------------------------------------------ forward
    def __call__(self, x, start_pos: int = 0):
        return self.forward(x, start_pos)

    def forward(self, x, start_pos: int = 0):
        """x float32 [B, S, dim] -> float32 [B, S, dim]."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 3 or x.shape[2] != self.cfg.dim:
            raise ValueError(f"CSALayer: 'x' must be [B, S, {self.cfg.dim}], got {x.shape}")
        B, S, _ = x.shape
        if B > self.batch:
            raise ValueError(f"CSALayer: batch {B} larger than the layer's {self.batch}")
        if start_pos < 0 or start_pos + S > self.max_seq_len:
            raise ValueError(f"CSALayer: positions {start_pos}..{start_pos + S - 1} outside "
                             f"0..{self.max_seq_len - 1}")
        if start_pos and S != 1:
            raise ValueError("CSALayer: a call at start_pos > 0 is a decode step of one token "
                             f"per row, got S={S}")
        if start_pos and start_pos != self._pos:
            raise ValueError(f"CSALayer: decode at start_pos={start_pos}, but the layer is at "
                             f"position {self._pos}")
        if start_pos == 0:
            self.reset()
        small = B * S <= 16
        with _blas_limit(self.decode_blas_threads if small else None):
            proj = self.project(x)
        o = self.attend(proj, start_pos)
        with _blas_limit(self.decode_blas_threads if small else None):
            y = self.out_proj(o)
        self._pos = start_pos + S
        return y

    def project(self, x):
        """The dense projections that depend on x only (NumPy matmul)."""
        t0 = time.perf_counter()
        W, cfg, r = self.w, self.cfg, self.ratio
        B, S, _ = x.shape
        p = {"x": x}
        qr = x @ W["wq_a.weight"].T
        t0 = self._tick(_PROJ, t0)
        _dc.rms_norm(qr, W["q_norm.weight"], cfg.norm_eps, out=qr)
        t0 = self._tick("rms_norm", t0)
        p["qr"] = qr
        p["q"] = (qr @ W["wq_b.weight"].T).reshape(B, S, cfg.n_heads, cfg.head_dim)
        p["kv"] = x @ W["wkv.weight"].T
        if r and (self.version == "v4" or self.kv_source):
            p["ckv"] = x @ W["compressor.wkv.weight"].T
            if "compressor.wgate.weight" in W:
                p["cscore"] = x @ W["compressor.wgate.weight"].T
        if r and (self.version == "v4" and r == 4 or self.version == "v4.1" and self.index_source):
            p["iq"] = (qr @ W["indexer.wq_b.weight"].T).reshape(B, S, cfg.index_heads,
                                                                  cfg.index_head_dim)
            p["iw"] = x @ (W["indexer.weights_proj.weight"].T
                           * np.float32(cfg.index_head_dim ** -0.5 * cfg.index_heads ** -0.5))
            if self.version == "v4":
                p["ickv"] = x @ W["indexer.compressor.wkv.weight"].T
                p["icscore"] = x @ W["indexer.compressor.wgate.weight"].T
        self._tick(_PROJ, t0)
        return p

    def attend(self, p, start_pos):
        """Everything between the projections, through the kernels; returns o [B,S,H,D]
        (de-rotated), the input of the output projection."""
        cfg, W, r = self.cfg, self.w, self.ratio
        B, S = p["x"].shape[:2]
        Dr, win = cfg.rope_dim, cfg.window
        cos, sin = self._cos[start_pos:start_pos + S], self._sin[start_pos:start_pos + S]
        v41 = self.version == "v4.1"
        t = time.perf_counter()
        q, kv = p["q"], p["kv"].reshape(B, S, cfg.head_dim)
        if cfg.q_head_rms_norm:      # V4 only: V4.1's query goes to RoPE as projected
            _dc.rms_norm(q, None, cfg.norm_eps, out=q)
        _dc.rms_norm(kv, W["kv_norm.weight"], cfg.norm_eps, out=kv)
        t = self._tick("rms_norm", t)
        _dc.apply_rope(q[..., -Dr:], cos, sin)
        _dc.apply_rope(kv[..., -Dr:], cos, sin)
        t = self._tick("rope", t)
        self._fp8(kv if cfg.window_fp8_rope else kv[..., :-Dr], cfg.window_fp8_block)
        t = self._tick("qat", t)
        # window ring
        if start_pos == 0:
            keep = min(S, win)
            slots = np.arange(S - keep, S) % win
            self._kv[:B, slots] = kv[:, S - keep:]
        else:
            self._kv[:B, start_pos % win] = kv[:, 0]
        widx = _dc.window_topk_idxs(win, B, S, start_pos)
        t = self._tick("index_lists", t)
        offset = S if start_pos == 0 else win
        if not r:
            kv_all, idx = (kv if start_pos == 0 else self._kv[:B]), widx
            self.last_topk = None
        else:
            cidx, n = self._compressed(p, start_pos, offset, B, S)
            t = time.perf_counter()
            self.last_topk = cidx
            idx = np.concatenate((widx, cidx.astype(np.int32, copy=False)), axis=-1)
            if v41 and not self.kv_source:
                src = self.shared.compress_kv
                win_kv = kv if start_pos == 0 else self._kv[:B]
                kv_all = np.concatenate((win_kv, src[:B, :n]), axis=1)
            elif start_pos == 0:
                kv_all = np.concatenate((kv, self._kv[:B, win:win + n]), axis=1)
            else:
                kv_all = self._kv[:B, :win + n]
            t = self._tick("index_lists", t)
        t = time.perf_counter()
        o = _dc.sparse_attn(q, kv_all, W["attn_sink"], idx, cfg.head_dim ** -0.5)
        t = self._tick("sparse_attn", t)
        _dc.apply_rope(o[..., -Dr:], cos, sin, inverse=True)
        self._tick("rope", t)
        return o

    def out_proj(self, o):
        t = time.perf_counter()
        cfg = self.cfg
        B, S = o.shape[:2]
        G = cfg.o_groups
        og = o.reshape(B * S, G, -1).transpose(1, 0, 2)            # [G, N, H*D/G]
        y = np.matmul(og, self._wo_a)                              # [G, N, o_lora]
        y = y.transpose(1, 0, 2).reshape(B * S, G * cfg.o_lora_rank)
        out = (y @ self.w["wo_b.weight"].T).reshape(B, S, cfg.dim)
        self._tick(_PROJ, t)
        return out

    # ------------------------------------------------------------------ compressed part
    def _entry_rows(self, start_pos, g):
        """First compressed index written by this call and the RoPE rows of its entries."""
        r = self.ratio
        first = 0 if start_pos == 0 else start_pos // r
        sl = slice(first * r, (first + g) * r, r)
        return first, self._cos[sl], self._sin[sl]

    def _pool(self, comp, kv, score, start_pos):
        if start_pos == 0:
            e = comp.prefill(kv, score)
            return e if e.shape[1] else None
        return comp.step(kv, score, start_pos)

    def _compressed(self, p, start_pos, offset, B, S):
        if self.version == "v4":
            return self._compressed_v4(p, start_pos, offset, B, S)
        return self._compressed_v41(p, start_pos, offset, B, S)

    def _compressed_v4(self, p, start_pos, offset, B, S):
        cfg, r = self.cfg, self.ratio
        Dr, win = cfg.rope_dim, cfg.window
        n = (start_pos + S) // r
        t = time.perf_counter()
        if r == 4:
            # indexer: its own compressor first (keys), then queries, then the top-k
            e = self._pool(self._icomp, p["ickv"], p["icscore"], start_pos)
            if e is not None:
                first = 0 if start_pos == 0 else start_pos // r
                self._store_index_keys(e, B, first)
            t = self._tick("compressor", t)
            iq = p["iq"]
            cos, sin = self._cos[start_pos:start_pos + S], self._sin[start_pos:start_pos + S]
            _dc.apply_rope(iq[..., -Dr:], cos, sin)
            t = self._tick("rope", t)
            self._index_rotate_round(iq)   # iq is this call's own projection
            t = self._tick("qat", t)
            cidx = _dc.index_topk(iq, self._ik[:B, :n], p["iw"], self.index_topk, ratio=r,
                                  start_pos=start_pos, offset=offset, order=cfg.index_order)
            t = self._tick("indexer", t)
        else:
            cidx = _dc.compress_topk_idxs(r, B, S, start_pos, offset)
            t = self._tick("index_lists", t)
        e = self._pool(self._comp, p["ckv"], p["cscore"], start_pos)
        if e is not None:
            first = 0 if start_pos == 0 else start_pos // r
            self._kv[:B, win + first:win + first + e.shape[1]] = e
        self._tick("compressor", t)
        return cidx, n

    def _compressed_v41(self, p, start_pos, offset, B, S):
        cfg, W, r, sh = self.cfg, self.w, self.ratio, self.shared
        Dr = cfg.rope_dim
        n = (start_pos + S) // r
        t = time.perf_counter()
        latent = None
        if self.kv_source:
            latent = self._pool(self._comp, p["ckv"], p.get("cscore"), start_pos)
            t = self._tick("compressor", t)
            sh.compress_kv = self._kv[:, cfg.window:]
            if self.index_source and (latent is not None
                                      or cfg.index_key_publish == "every_call"):
                sh.index_k = self._ik
            if latent is not None:
                first, c, s = self._entry_rows(start_pos, latent.shape[1])
                if self.index_source:
                    k = latent @ W["indexer.wk.weight"].T
                    t = self._tick(_PROJ, t)
                    _dc.rms_norm(k, W["indexer.k_norm.weight"], cfg.norm_eps, out=k)
                    t = self._tick("rms_norm", t)
                    _dc.apply_rope(k[..., -Dr:], c, s)
                    t = self._tick("rope", t)
                    self._index_rotate_round(k)
                    t = self._tick("qat", t)
                    self._store_index_keys(k, B, first)
                _dc.apply_rope(latent[..., -Dr:], c, s)
                t = self._tick("rope", t)
                self._round_entries(latent)
                t = self._tick("qat", t)
                self._kv[:B, cfg.window + first:cfg.window + first + latent.shape[1]] = latent
        if self.index_source:
            if n == 0:
                cidx = np.full((B, S, 0), -1, np.int32)
            else:
                iq = p["iq"]
                cos, sin = self._cos[start_pos:start_pos + S], self._sin[start_pos:start_pos + S]
                _dc.apply_rope(iq[..., -Dr:], cos, sin)
                t = self._tick("rope", t)
                self._index_rotate_round(iq)
                t = self._tick("qat", t)
                k = sh.index_k[:B, :n]
                if self.candidate_source:
                    sc = _dc.index_scores(iq, k, p["iw"], ratio=r, start_pos=start_pos)
                    sh.candidates = _dc.select_candidate_blocks(
                        sc, self.candidate_topk_blocks, self.candidate_block_size, ratio=r,
                        start_pos=start_pos)
                    cidx = _dc.topk_indices(sc, self.index_topk, ratio=r, start_pos=start_pos,
                                            offset=offset, order=cfg.index_order)
                else:
                    kw = {}
                    if self.uses_candidates:
                        kw = dict(candidates=sh.candidates,
                                  block_size=self.candidate_block_size)
                    cidx = _dc.index_topk(iq, k, p["iw"], self.index_topk, ratio=r,
                                          start_pos=start_pos, offset=offset,
                                          order=cfg.index_order, **kw)
                t = self._tick("indexer", t)
            sh.topk_idxs = cidx
        else:
            if sh.topk_idxs is None:
                raise RuntimeError("CSALayer: V4.1 reader before any index source ran")
            cidx = sh.topk_idxs
        return cidx, n
