"""Outputs of every public kernel on fixed inputs at every ISA level this build has,
saved to an .npz (key "<level>/<kernel>"), so that two builds of the module (gcc and
clang: tests/test_clang.py) can be compared bit for bit.  Usage:
    python tests/compiler_probe.py OUT.npz      (with the build to probe importable)"""
import sys

import ml_dtypes
import numpy as np

import deepseek_csa as dc

BF16 = ml_dtypes.bfloat16


def inputs():
    rng = np.random.default_rng(29)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    d = {}
    d["x"] = f(37, 193)
    d["w"] = f(193)
    d["xb"] = f(9, 512).astype(BF16)
    d["wb"] = f(512)
    cos, sin = dc.rope_table(64, 40, base=10000.0)
    d["cos"], d["sin"], d["rx"] = cos[:40], sin[:40], f(2, 40, 3, 64)
    d["q"], d["kv"], d["sink"] = f(2, 5, 16, 192), f(2, 97, 192), f(16)
    d["idx"] = rng.integers(-1, 97, (2, 5, 23)).astype(np.int32)
    d["pkv"], d["psc"] = f(2, 64, 2 * 96), f(2, 64, 2 * 96)
    d["iq"], d["ik"], d["iw"] = f(2, 40, 12, 128), f(2, 10, 128), f(2, 40, 12)
    d["hx"] = f(8, 256)
    d["ga"], d["gb"] = f(33, 640), f(130, 640)
    d["mix"], d["hsc"], d["hbase"] = f(3, 5, 24), np.array([0.7, 1.3, 1.1], np.float32), \
        0.1 * f(24)
    return d


def run(d):
    o = {}
    o["rms_norm"] = dc.rms_norm(d["x"], d["w"], 1e-6)
    o["rms_norm_bf16"] = dc.rms_norm(d["xb"], d["wb"], 1e-6).view(np.uint16)
    r = d["rx"].copy()
    dc.apply_rope(r, d["cos"], d["sin"])
    o["rope"] = r
    o["attn"] = dc.sparse_attn(d["q"], d["kv"], d["sink"], d["idx"], 0.07)
    o["attn_bf16"] = dc.sparse_attn(d["q"].astype(BF16), d["kv"].astype(BF16), d["sink"],
                                    d["idx"], 0.07).view(np.uint16)
    o["pool"] = dc.gated_pool(d["pkv"], d["psc"], 4, overlap=True)
    o["index_scores"] = dc.index_scores(d["iq"], d["ik"], d["iw"], ratio=4)
    o["index_scores_bf16"] = dc.index_scores(d["iq"].astype(BF16), d["ik"].astype(BF16),
                                             d["iw"], ratio=4)
    o["index_topk"] = dc.index_topk(d["iq"], d["ik"], d["iw"], 4, ratio=4)
    o["hadamard"] = dc.hadamard(d["hx"])
    o["fp8_round"] = dc.fp8_round(d["hx"].copy(), 64)
    o["fp4_round"] = dc.fp4_round(d["hx"].copy(), 32)
    a, a_s = dc.fp8_quant(d["ga"])
    b, b_s = dc.fp8_quant(d["gb"])
    o["fp8_gemm"] = dc.fp8_gemm(a, a_s, b, b_s[::128].copy(), out_dtype="float32")
    b4, b4_s = dc.fp4_quant(d["gb"])       # fp8 activations x fp4 weights
    o["fp4_gemm"] = dc.fp4_gemm(a, a_s, b4, b4_s, out_dtype="float32")
    for i, t in enumerate(dc.hc_split_sinkhorn(d["mix"], d["hsc"], d["hbase"], 4, 20, 1e-6)):
        o[f"sinkhorn{i}"] = t
    return {k: np.asarray(v) for k, v in o.items()}


def main(path):
    d = inputs()
    out = {}
    for level in dc.build_info()["isa_levels"]:
        dc.set_isa(level)
        if dc.get_isa() != level:
            continue
        for k, v in run(d).items():
            out[f"{level}/{k}"] = v
    np.savez(path, **out)
    print("levels", [lv for lv in dc.build_info()["isa_levels"] if f"{lv}/attn" in out])


if __name__ == "__main__":
    main(sys.argv[1])
