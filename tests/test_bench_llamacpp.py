"""benchmarks/bench_llamacpp.py without llama.cpp: the skip path (no `make peers` build)
and the FP4 -> MXFP4 re-encoding (checked against a decoder of ggml's block layout
written here from its definition: {uint8 e; uint8 qs[16]} per 32 values, qs[j] holding
element j in the low nibble and element j + 16 in the high one, value = e2m1(code) *
2^(e - 127))."""
import importlib.util
from pathlib import Path

import numpy as np

import deepseek_csa as dc

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_llamacpp",
                                              ROOT / "benchmarks" / "bench_llamacpp.py")
bl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bl)

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def test_skips_without_the_build(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bl, "LIB", tmp_path / "libcsa_ggml_ops.so")
    assert bl.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SKIP bench_llamacpp:") and "make peers" in out


def _decode_mxfp4(rows, K):
    N = rows.shape[0]
    blk = rows.reshape(N, K // 32, 17)
    e, qs = blk[..., 0].astype(np.float64), blk[..., 1:]
    codes = np.concatenate([qs & 15, qs >> 4], -1)              # elements 0..15, 16..31
    return (E2M1[codes] * 2.0 ** (e - 127)[..., None]).reshape(N, K)


def test_fp4_to_mxfp4_is_exact():
    rng = np.random.default_rng(0)
    for N, K in ((3, 32), (5, 96), (16, 4096)):
        w = rng.standard_normal((N, K), dtype=np.float32)
        b4, s = dc.fp4_quant(w, 32)                              # ours: uint8 e8m0 scales
        codes = np.stack([b4 & 15, b4 >> 4], -1).reshape(N, K)
        want = E2M1[codes] * np.repeat(2.0 ** (s.astype(np.float64) - 127), 32, 1)
        got = _decode_mxfp4(bl.fp4_to_mxfp4(b4, s), K)
        assert np.array_equal(got, want)
