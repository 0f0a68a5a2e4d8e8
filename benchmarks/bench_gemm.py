"""fp8_gemm / fp4_gemm, the released kernel module's block-scaled GEMMs.

Decode (one activation row) is bound by the weight bytes: GB/s of weight bytes (plus
their scales) against stream bandwidth.  Prefill (4096 rows on the same weights) is
bound by the fp32 FMA peak.  The eager side is torch's dequantize-then-matmul path: the
FP8 / FP4 codes decoded to float32 with their block scales (e4m3 by torch's own cast,
e2m1 by a table lookup on the nibbles), then one float32 matmul, the result cast to
bf16 -- what a CPU user of the released model.py would write without these kernels.
Shapes: V4-Flash ``wq_b`` (N = 32768, K = 1024) and a routed expert's ``w1``
(moe_inter_dim 2048 x dim 4096, FP4).  The decode rows are timed a second time against
the same path in bfloat16 (codes decoded to bf16, a bf16 matmul).

    python benchmarks/bench_gemm.py [--threads 1,2] [--quick] [--no-compile]

writes benchmarks/results/gemm.json (the rows of the previous snapshot kept under
"before") and gemm.png; run.py picks up cases() as well.
"""
import argparse
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import deepseek_csa as dc  # noqa: E402
import harness  # noqa: E402
from harness import Case  # noqa: E402

_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _deq_a(a8, a_s):
    return a8.float() * a_s.repeat_interleave(128, -1)[..., :a8.shape[-1]]


def _fp8_ref(a8, a_s, b8, b_s, dt=torch.float32):
    n, k = b8.shape
    B = b8.to(dt) * b_s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k].to(dt)
    return (_deq_a(a8, a_s).to(dt) @ B.T).bfloat16()


def _fp4_ref(a8, a_s, b4, b_s, dt=torch.float32):
    u = b4.view(torch.uint8).long()
    B = torch.stack([_E2M1[u & 15], _E2M1[u >> 4]], -1).flatten(-2).to(dt)
    B = B * b_s.repeat_interleave(32, 1).to(dt)
    return (_deq_a(a8, a_s).to(dt) @ B.T).bfloat16()


def _codes(rng, shape):
    u = rng.integers(0, 256, shape).astype(np.uint8)
    u[(u & 0x7F) == 0x7F] ^= 1
    return u


def cases(quick=False):
    rng = np.random.default_rng(0)
    T = torch.from_numpy
    out = []
    N, K = (32768, 1024) if not quick else (8192, 1024)
    b8 = _codes(rng, (N, K))
    b8s = (2.0 ** rng.integers(-9, -5, (N // 128, K // 128))).astype(np.float32)
    tb8, tb8s = T(b8).view(torch.float8_e4m3fn), T(b8s)
    for M in (1, 4096 if not quick else 256):
        a8 = _codes(rng, (M, K))
        a8s = (2.0 ** rng.integers(-6, -2, (M, K // 128))).astype(np.float32)
        ta8, ta8s = T(a8).view(torch.float8_e4m3fn), T(a8s)
        decode = M == 1
        out.append(Case(
            "fp8_gemm", f"M={M} N={N} K={K} (V4-Flash wq_b) {'decode' if decode else 'prefill'}",
            ours=lambda a=ta8, s=ta8s: dc.fp8_gemm(a, s, tb8, tb8s),
            eager=lambda a=ta8, s=ta8s: _fp8_ref(a, s, tb8, tb8s),
            compile_fn=_fp8_ref if decode else None, compile_args=(ta8, ta8s, tb8, tb8s),
            bytes=b8.nbytes + b8s.nbytes if decode else 0.0,
            flops=0.0 if decode else 2.0 * M * N * K,
            bound="memory" if decode else "compute", reps=0 if decode else 3))
        if decode:
            out.append(Case(
                "fp8_gemm", f"M={M} N={N} K={K} (V4-Flash wq_b) decode, vs bf16 dequant",
                ours=lambda a=ta8, s=ta8s: dc.fp8_gemm(a, s, tb8, tb8s),
                eager=lambda a=ta8, s=ta8s: _fp8_ref(a, s, tb8, tb8s, torch.bfloat16),
                bytes=b8.nbytes + b8s.nbytes, bound="memory"))
    Ne, Ke = 2048, 4096
    b4 = rng.integers(0, 256, (Ne, Ke // 2)).astype(np.uint8)
    b4s = rng.integers(118, 124, (Ne, Ke // 32)).astype(np.uint8)
    tb4, tb4s = T(b4).view(torch.float4_e2m1fn_x2), T(b4s).view(torch.float8_e8m0fnu)
    b4sf = T((2.0 ** (b4s.astype(np.float32) - 127)).astype(np.float32))
    a4 = _codes(rng, (1, Ke))
    a4s = (2.0 ** rng.integers(-6, -2, (1, Ke // 128))).astype(np.float32)
    ta4, ta4s = T(a4).view(torch.float8_e4m3fn), T(a4s)
    out.append(Case(
        "fp4_gemm", f"M=1 N={Ne} K={Ke} (V4-Flash expert w1) decode",
        ours=lambda: dc.fp4_gemm(ta4, ta4s, tb4, tb4s),
        eager=lambda: _fp4_ref(ta4, ta4s, tb4, b4sf),
        # Inductor has no float4_e2m1fn_x2 (KeyError): compile gets the same bytes as uint8
        compile_fn=_fp4_ref, compile_args=(ta4, ta4s, T(b4), b4sf),
        bytes=b4.nbytes + b4s.nbytes, bound="memory"))
    out.append(Case(
        "fp4_gemm", f"M=1 N={Ne} K={Ke} (V4-Flash expert w1) decode, vs bf16 dequant",
        ours=lambda: dc.fp4_gemm(ta4, ta4s, tb4, tb4s),
        eager=lambda: _fp4_ref(ta4, ta4s, tb4, b4sf, torch.bfloat16),
        bytes=b4.nbytes + b4s.nbytes, bound="memory"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", default="2,1", help="comma-separated thread counts")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("-k", action="append", default=[], help="keep cases matching this word")
    ap.add_argument("--note", default="", help="a line about the host (load) for the JSON")
    a = ap.parse_args()
    from threadpoolctl import threadpool_limits
    path = harness.RESULTS / "gemm.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    runs, allrows = {}, []
    for th in [int(t) for t in a.threads.split(",")]:
        torch.set_num_threads(th)
        with threadpool_limits(th, user_api="openmp"):
            peaks = harness.machine_peaks(th, refresh=True)
            load = os.getloadavg()[0]
            rows = []
            for case in cases(a.quick):
                if a.k and not any(w in case.kernel or w in case.name for w in a.k):
                    continue
                row = harness.run_case(case, peaks, do_compile=not a.no_compile)
                row["case"] += f" [{th} thread{'s' if th > 1 else ''}]"
                row["load_avg_1min_at_start"] = load
                print(harness.fmt_row(row), flush=True)
                rows.append(row)
            runs[f"{th} thread{'s' if th > 1 else ''}"] = {
                "machine": peaks, "env": harness.environment(th), "rows": rows}
            allrows += rows
    out = {"note": "benchmarks/bench_gemm.py, interleaved against torch's dequantize-then-"
                   "matmul (float32; the decode rows also bf16) and torch.compile of it; "
                   "peaks re-measured at the start of each thread count. " + a.note,
           "runs": runs,
           "before": old.get("before") or {"note": re.sub(r"issue \d+ ", "", old.get("note", "")),
                                            "runs": old.get("runs", {})}}
    harness.RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    harness.plot(allrows, harness.RESULTS / "gemm.png")
    print(f"wrote {path} and gemm.png")


if __name__ == "__main__":
    main()
