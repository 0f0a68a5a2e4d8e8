"""Released DeepSeek-V4 / V4.1 attention configurations (SPEC.md, "Released configurations").

Each preset is a frozen dataclass; derive a variant with ``dataclasses.replace``.
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

    def rope_kwargs(self, ratio: int) -> dict:
        """Keyword arguments of ``rope_table`` for a layer of this compress ratio."""
        if ratio == 0:
            return dict(base=self.rope_theta)
        return dict(base=self.compress_rope_theta, original_seq_len=self.original_seq_len,
                    factor=self.yarn_factor, beta_fast=self.beta_fast, beta_slow=self.beta_slow)


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

# V4.1-Flash: the released config.json (SPEC's table leaves most of these to it, and
# its "hidden size 4096" is 5120 there; tests/test_norm_rope.py records the difference).
# compress_ratios includes the three trailing entries of the MTP layers, as released.
V41_FLASH = CSAConfig(
    name="DeepSeek-V4.1-Flash", dim=5120, n_layers=40, n_heads=64, head_dim=512, rope_dim=64,
    q_lora_rank=1280, o_lora_rank=1024, o_groups=8, window=128,
    compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3,
    index_heads=32, index_head_dim=128, index_topk=512, norm_eps=1e-20,
    kv_source_layers=(2, 8, 14, 20), index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
    candidate_source_layer=20, candidate_topk_blocks=2048, candidate_block_size=8, **_YARN)

PRESETS = {c.name: c for c in (V4_FLASH, V4_PRO, V41_FLASH)}
