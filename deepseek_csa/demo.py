"""`make demo`: a V4-Flash-shaped pass through the kernels on random inputs, NumPy only,
with a timing table.  (Grows into a whole CSA layer as the kernels land.)"""
import time

import numpy as np

import deepseek_csa as dc


def _time(fn, reps=5):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def main(seqlen=4096):
    cfg = dc.V4_FLASH
    rng = np.random.default_rng(0)
    print(f"{cfg.name}: {seqlen} tokens, H={cfg.n_heads}, D={cfg.head_dim}, rope {cfg.rope_dim}; "
          f"ISA {dc.get_isa()}, {dc.max_threads()} threads")
    q = rng.standard_normal((1, seqlen, cfg.n_heads, cfg.head_dim), dtype=np.float32)
    kv = rng.standard_normal((1, seqlen, cfg.head_dim), dtype=np.float32)
    w = rng.standard_normal(cfg.head_dim, dtype=np.float32)
    cos, sin = dc.rope_table(cfg.rope_dim, seqlen, **cfg.rope_kwargs(ratio=4))
    rows = [
        ("rope_table (YaRN)", lambda: dc.rope_table(cfg.rope_dim, seqlen, **cfg.rope_kwargs(4))),
        ("rms_norm kv [S, D]", lambda: dc.rms_norm(kv, w, eps=cfg.norm_eps)),
        ("rms_norm q per head", lambda: dc.rms_norm(q, out=q)),
        ("apply_rope q tail", lambda: dc.apply_rope(q[..., -cfg.rope_dim:], cos, sin)),
        ("apply_rope kv tail", lambda: dc.apply_rope(kv[:, :, None, -cfg.rope_dim:], cos, sin)),
    ]
    print(f"{'op':<24}{'ms':>10}")
    for name, fn in rows:
        print(f"{name:<24}{_time(fn) * 1e3:10.3f}")


if __name__ == "__main__":
    main()
