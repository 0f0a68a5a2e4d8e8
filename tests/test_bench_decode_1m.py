"""benchmarks/bench_decode_1m.py's bookkeeping without running it: the layer counts of the
released configs and the cache bytes of each side, against sizes worked out here from
the definitions (V4-Flash: head_dim 512, index_head_dim 128, window 128, ratios 4 / 128;
a bf16 / F16 value is 2 bytes, float32 4, an FP4 key row 128/2 + 128/32 = 68 bytes)."""
import dataclasses
import importlib.util
import sys
from pathlib import Path

import deepseek_csa as dc
from deepseek_csa.layer import CSALayer, random_layer_weights

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("bench_decode_1m",
                                              ROOT / "benchmarks" / "bench_decode_1m.py")
bd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bd)

M = 1 << 20


def test_layer_counts_of_the_released_configs():
    # V4-Flash: 43 backbone layers = 2 window-only, then (4, 128) x 20, then one more 4
    assert bd.layer_counts(dc.V4_FLASH) == {"csa": 21, "hca": 20, "window": 2, "other": 0}
    # V4-Pro: 61 = two HCA, then (4, 128) x 29, then 4
    assert bd.layer_counts(dc.V4_PRO) == {"csa": 30, "hca": 31, "window": 0, "other": 0}


def test_cache_bytes_at_1m():
    ll4, ll128 = bd.llama_cache_bytes(M, 4), bd.llama_cache_bytes(M, 128)
    assert ll4["compressed"] == M // 4 * 512 * 2 and ll4["index_keys"] == M // 4 * 128 * 2
    assert ll128["compressed"] == M // 128 * 512 * 2 and ll128["index_keys"] == 0
    assert ll4["window"] == 768 * 512 * 2          # 128 + n_ubatch 512, padded to 256
    r4, r128 = bd.released_buffer_bytes(M, 4), bd.released_buffer_bytes(M, 128)
    assert r4["kv"] == (128 + M // 4) * 512 * 2 and r4["index_keys"] == M // 4 * 128 * 2
    assert r128["kv"] == (128 + M // 128) * 512 * 2
    assert r4["rope_table"] == r128["rope_table"] == M * 32 * 8      # complex64, Dr/2 = 32
    # compressor state, float32 kv + score: overlap [2*4, 2*512] and the indexer's
    # [2*4, 2*128]; ratio 128: [128, 512]
    assert r4["compressor_state"] == 2 * 8 * 1024 * 4 + 2 * 8 * 256 * 4
    assert r128["compressor_state"] == 2 * 128 * 512 * 4


def test_ours_bytes_and_per_token_of_a_small_layer():
    ctx = 4096
    cfg = dataclasses.replace(dc.V4_FLASH, dim=64, q_lora_rank=32, o_lora_rank=32)
    mem = {"ours": {}, "llama_f16": {}, "released": {}}
    for kind, r in (("csa", 4), ("hca", 128)):
        lay = CSALayer(random_layer_weights(cfg, r), cfg, ratio=r, max_seq_len=ctx)
        b = bd.ours_bytes(lay)
        assert b["kv"] == (128 + ctx // r) * 512 * 4
        assert b["index_keys"] == (ctx // 4 * 68 if r == 4 else 0)
        assert b["rope_table"] == 2 * ctx * 32 * 4
        mem["ours"][kind] = b
        mem["llama_f16"][kind] = bd.llama_cache_bytes(ctx, r)
        mem["released"][kind] = bd.released_buffer_bytes(ctx, r)
    pt = bd.per_token_bytes({"context": ctx, "memory": mem})
    assert pt["ours_csa"] == 512 * 4 / 4 + 68 / 4 and pt["ours_hca"] == 512 * 4 / 128
    assert pt["llama_f16_csa"] == 512 * 2 / 4 + 128 * 2 / 4
    assert pt["llama_f16_hca"] == 256 * 512 * 2 / ctx    # 32 entries, padded to 256 cells
    assert pt["released_csa"] == 320 and pt["released_hca"] == 8
