"""Released DeepSeek-V4 / V4.1 attention configurations (the released config.json files).

Each preset is a frozen dataclass; derive a variant with ``dataclasses.replace``.

Every arithmetic difference between V4 and V4.1 is an explicit field (docs/layers.md;
the defaults are V4's), so a layer never guesses a version from the shape of a config:

=====================  ==========================  =================================
field                  V4-Flash / V4-Pro           V4.1-Flash
=====================  ==========================  =================================
q_head_rms_norm        True (per-head rescale)     False (dropped)
window_fp8_block       64                          32
window_fp8_rope        False (first D - Dr)        True (all D features)
compressed_kv_quant    "fp8" (e4m3, ue8m0, 64)     "fp4_e4m3" (e2m1, e4m3 scales, 16)
index_hadamard         True                        False
index_order            "score"                     "position"
kv_source_layers       None (every layer its own)  (2, 8, 14, 20): shared sources
=====================  ==========================  =================================

``index_key_publish`` (V4.1's layout only) chooses when an index-key owner publishes its
key cache to the index layers: "every_call" (the default: decode equals prefill) or
"on_entry", the released V4.1 model.py's behaviour (only on calls where the owner's
compressor emits an entry, so on a decode step inside a ratio-2 group its index layers
score against the keys of whichever owner published last; docs/layers.md measures it).

``kv_source_layers`` chooses the layout: None is V4's (each compressed layer pools its
own KV; ratio-4 layers run an indexer with its own overlapping compressor), a tuple is
V4.1's (sources pool and publish, the other layers read; index keys come from the
source's latent).  A config that mixes fields the layout cannot honour is refused at
construction with an error naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class CSAConfig:
    name: str
    dim: int                       # hidden size
    n_layers: int                  # backbone layers (MTP layers not counted)
    n_heads: int                   # attention heads H
    head_dim: int                  # D, also the compressed KV width
    rope_dim: int                  # Dr, the LAST Dr features of a vector
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    window: int                    # sliding window
    compress_ratios: Tuple[int, ...]   # per layer as released (V4: the last entry is the MTP layer); 0 = window-only
    index_heads: int               # Hi
    index_head_dim: int            # Di
    index_topk: int
    rope_theta: float              # ratio-0 layers, no YaRN
    compress_rope_theta: float     # ratio > 0 layers, with YaRN
    yarn_factor: float
    original_seq_len: int
    beta_fast: float
    beta_slow: float
    norm_eps: float
    # V4.1 only: the layers that pool compressed KV / run an indexer, the indexer layer
    # whose candidate blocks (two-level top-k) the later index layers score within
    kv_source_layers: Optional[Tuple[int, ...]] = None
    index_source_layers: Optional[Tuple[int, ...]] = None
    candidate_source_layer: Optional[int] = None
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    # The V4 / V4.1 arithmetic differences (module docstring); defaults are V4's.
    q_head_rms_norm: bool = True       # unweighted per-head RMS rescale of q before its RoPE
    window_fp8_block: int = 64         # FP8 QAT block of the window KV
    window_fp8_rope: bool = False      # the window FP8 covers the RoPE tail too (all D)
    compressed_kv_quant: str = "fp8"   # QAT of compressed KV entries: "fp8" or "fp4_e4m3"
    index_hadamard: bool = True        # Walsh-Hadamard rotation of indexer queries and keys
    index_order: str = "score"         # top-k order: "score" (descending) or "position"
    # V4.1: when an index-key owner publishes its keys, "every_call" or "on_entry" (the
    # released model.py: only when its compressor emits an entry; module docstring)
    index_key_publish: str = "every_call"

    def __post_init__(self):
        _validate(self)

    @property
    def shared_sources(self) -> bool:
        """True for V4.1's layout (kv / index sources publish, the other layers read)."""
        return self.kv_source_layers is not None

    def rope_kwargs(self, ratio: int) -> dict:
        """Keyword arguments of ``rope_table`` for a layer of this compress ratio."""
        if ratio == 0:
            return dict(base=self.rope_theta)
        return dict(base=self.compress_rope_theta, original_seq_len=self.original_seq_len,
                    factor=self.yarn_factor, beta_fast=self.beta_fast, beta_slow=self.beta_slow)


def _bad(cfg, field, expected, got):
    raise ValueError(f"CSAConfig {cfg.name!r}: '{field}' {expected}, got {got!r}")


def _validate(c: "CSAConfig"):
    if not isinstance(c.q_head_rms_norm, bool):
        _bad(c, "q_head_rms_norm", "must be a bool", c.q_head_rms_norm)
    if not isinstance(c.window_fp8_rope, bool):
        _bad(c, "window_fp8_rope", "must be a bool", c.window_fp8_rope)
    if not isinstance(c.index_hadamard, bool):
        _bad(c, "index_hadamard", "must be a bool", c.index_hadamard)
    if c.compressed_kv_quant not in ("fp8", "fp4_e4m3"):
        _bad(c, "compressed_kv_quant", "must be 'fp8' or 'fp4_e4m3'", c.compressed_kv_quant)
    if c.index_order not in ("score", "position"):
        _bad(c, "index_order", "must be 'score' or 'position'", c.index_order)
    if c.index_key_publish not in ("every_call", "on_entry"):
        _bad(c, "index_key_publish", "must be 'every_call' or 'on_entry'", c.index_key_publish)
    width = c.head_dim if c.window_fp8_rope else c.head_dim - c.rope_dim
    if c.window_fp8_block < 1 or width % c.window_fp8_block:
        _bad(c, "window_fp8_block", f"must divide the {width} window features it rounds",
             c.window_fp8_block)
    if c.compressed_kv_quant == "fp8" and (c.head_dim - c.rope_dim) % 64:
        _bad(c, "compressed_kv_quant", f"'fp8' needs head_dim - rope_dim = "
             f"{c.head_dim - c.rope_dim} to be a multiple of 64", c.compressed_kv_quant)
    if c.compressed_kv_quant == "fp4_e4m3" and c.head_dim % 16:
        _bad(c, "compressed_kv_quant", f"'fp4_e4m3' needs head_dim {c.head_dim} to be a "
             "multiple of 16", c.compressed_kv_quant)
    ratios = c.compress_ratios
    if not c.shared_sources:
        # V4's layout has no sources: the V4.1 sharing fields would be silently ignored
        for f in ("index_source_layers", "candidate_source_layer"):
            if getattr(c, f) is not None:
                _bad(c, f, "needs kv_source_layers (V4.1's shared layout); it is None", getattr(c, f))
        return
    n = len(ratios)
    for f in ("kv_source_layers", "index_source_layers"):
        ids = getattr(c, f) or ()
        bad = [i for i in ids if not (0 <= i < n and ratios[i] > 0)]
        if bad:
            _bad(c, f, "must name layers with compress ratio > 0", tuple(bad))
    # a reader reads what the LAST source before it published, whatever its ratio
    for f, ids in (("kv_source_layers", c.kv_source_layers), ("index_source_layers",
                                                             c.index_source_layers)):
        if ids is None:
            continue
        for i, r in enumerate(ratios):
            last = max((j for j in ids if j <= i), default=None)
            if r and (last is None or ratios[last] != r):
                _bad(c, f, f"must hold a ratio-{r} layer as the last source at or before "
                     f"layer {i} (which reads what that source publishes)", ids)
    idx = c.index_source_layers
    cs = c.candidate_source_layer
    if cs is not None:
        if idx is None or cs not in idx:
            _bad(c, "candidate_source_layer", "must be one of index_source_layers", cs)
        if c.candidate_topk_blocks < 1 or c.candidate_block_size < 1:
            _bad(c, "candidate_topk_blocks", "and candidate_block_size must be >= 1 with a "
                 "candidate source", (c.candidate_topk_blocks, c.candidate_block_size))
        later = [i for i in idx if i > cs and ratios[i] != ratios[cs]]
        if later:
            _bad(c, "index_source_layers", f"after the candidate source (layer {cs}, ratio "
                 f"{ratios[cs]}) must share its ratio (they score within its blocks)",
                 tuple(later))


_YARN = dict(rope_theta=10000.0, compress_rope_theta=160000.0, yarn_factor=16.0,
             original_seq_len=65536, beta_fast=32.0, beta_slow=1.0)

V4_FLASH = CSAConfig(
    name="DeepSeek-V4-Flash", dim=4096, n_layers=43, n_heads=64, head_dim=512, rope_dim=64,
    q_lora_rank=1024, o_lora_rank=1024, o_groups=8, window=128,
    compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0),
    index_heads=64, index_head_dim=128, index_topk=512, norm_eps=1e-6, **_YARN)

V4_PRO = CSAConfig(
    name="DeepSeek-V4-Pro", dim=7168, n_layers=61, n_heads=128, head_dim=512, rope_dim=64,
    q_lora_rank=1536, o_lora_rank=1024, o_groups=16, window=128,
    compress_ratios=(128, 128) + (4, 128) * 29 + (4, 0),
    index_heads=64, index_head_dim=128, index_topk=1024, norm_eps=1e-6, **_YARN)

# V4.1-Flash: the released config.json (the design notes left most of these to it, and
# its "hidden size 4096" is 5120 there; tests/test_norm_rope.py records the difference).
# compress_ratios includes the three trailing entries of the MTP layers, as released.
V41_FLASH = CSAConfig(
    name="DeepSeek-V4.1-Flash", dim=5120, n_layers=40, n_heads=64, head_dim=512, rope_dim=64,
    q_lora_rank=1280, o_lora_rank=1024, o_groups=8, window=128,
    compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3,
    index_heads=32, index_head_dim=128, index_topk=512, norm_eps=1e-20,
    kv_source_layers=(2, 8, 14, 20), index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
    candidate_source_layer=20, candidate_topk_blocks=2048, candidate_block_size=8,
    q_head_rms_norm=False, window_fp8_block=32, window_fp8_rope=True,
    compressed_kv_quant="fp4_e4m3", index_hadamard=False, index_order="position", **_YARN)

PRESETS = {c.name: c for c in (V4_FLASH, V4_PRO, V41_FLASH)}
