"""One V4-Flash-width layer of a model.py loaded through deepseek_csa.torch.load_model_py
with FP8 weights (FP4 routed experts): the time of one decode step and the peak memory
it takes, against the same file and the same weights run on float32 torch stand-ins
for its ``kernel`` module (what a CPU user writes without this package: FP8 / FP4 codes
decoded with their block scales to float32 on every call, then a float32 matmul).

The model file is tests/tiny_model/model.py (this project's own V4-shaped layer: hyper-
connections, a window attention with a sink whose queries go through the low-rank
wq_a / wq_b pair, a routed MoE plus a shared expert), built here with V4-Flash's widths
through its ModelArgs: dim 4096, 64 heads of 512 (rope 64), q_lora_rank 1024 (so wq_b is
the 32768 x 1024 FP8 matrix of bench_gemm), hc_mult 4, expert inter dim 2048; 8 routed
experts with 6 active per token (V4-Flash has 256; the per-token work is the same).

    python benchmarks/bench_model_py.py [--threads 2] [--steps N] [--isa avx2]

writes benchmarks/results/model_py.json and model_py.png; run.py also picks up cases().
"""
import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402

MODEL_PY = HERE.parent / "tests" / "tiny_model" / "model.py"
FLASH = dict(max_batch_size=1, max_seq_len=256, dtype="fp8", expert_dtype="fp4",
             scale_fmt="ue8m0", vocab_size=1024, dim=4096, n_layers=1, n_heads=64,
             head_dim=512, rope_head_dim=64, q_lora_rank=1024, window_size=128,
             n_routed_experts=8, n_activated_experts=6, moe_inter_dim=2048, hc_mult=4,
             hc_sinkhorn_iters=20)
PROMPT = 16


# ----------------------------------------------------------------------------- stand-ins
def standin_modules():
    """The float32 torch stand-ins of the kernel module (the tests' replay oracle)."""
    from deepseek_csa.reference import kernel_module
    return kernel_module.standin_modules()


def load_with(mods, name):
    """Imports MODEL_PY under `name` with `mods` in sys.modules."""
    from deepseek_csa.torch.kernel_module import preserved_modules
    with preserved_modules(mods):
        sys.modules.update(mods)
        spec = importlib.util.spec_from_file_location(name, MODEL_PY)
        m = importlib.util.module_from_spec(spec)
        sys.modules[name] = m
        spec.loader.exec_module(m)
    return m


# ----------------------------------------------------------------------------- the model
class _Default:
    def __init__(self, dt):
        self.dt = dt

    def __enter__(self):
        self.old = torch.get_default_dtype()
        torch.set_default_dtype(self.dt)

    def __exit__(self, *e):
        torch.set_default_dtype(self.old)


def fill(model, mod, seed=0):
    """Random weights the layer stays finite on: FP8 codes of moderate exponent with e8m0
    scales of 1/sqrt(K) order, FP4 codes likewise, float parameters normal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        done = set()
        for m in model.modules():
            if not isinstance(m, mod.Linear):
                continue
            done |= {id(m.weight), id(m.scale)}
            k = m.in_features
            u = torch.randint(0, 256, m.weight.shape, generator=g, dtype=torch.uint8)
            if m.weight.dtype == torch.float8_e4m3fn:
                u = (u & 0x87) | 0x38          # |value| in [1, 1.875]: exponent 7
                e = 127 + int(np.round(np.log2(k ** -0.5)))
            else:
                e = 127 + int(np.round(np.log2(k ** -0.5 / 3)))
            m.weight.view(torch.uint8).copy_(u)
            m.scale.view(torch.uint8).copy_(torch.full(m.scale.shape, e, dtype=torch.uint8))
        for name, p in model.named_parameters():
            if id(p) in done:
                continue
            if name.endswith("norm.weight") or ("hc_" in name and name.endswith("scale")):
                v = 1 + 0.1 * torch.randn(p.shape, generator=g)
            elif "_fn" in name:
                v = 0.5 * torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5
            else:
                v = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
            p.copy_(v.to(p.dtype))


def weight_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def build(quick=False):
    import deepseek_csa.torch as dct
    cfg = dict(FLASH)
    if quick:
        cfg.update(n_heads=16, n_routed_experts=4, n_activated_experts=2)
    ours_mod = dct.load_model_py(MODEL_PY)
    sa_mods = standin_modules()
    sa_mod = load_with(sa_mods, "bench_model_py_standin")
    with _Default(torch.bfloat16):
        ours = ours_mod.Transformer(ours_mod.ModelArgs(**cfg))
        fill(ours, ours_mod)
        sa = sa_mod.Transformer(sa_mod.ModelArgs(**cfg))
        sa.load_state_dict(ours.state_dict())     # the very same FP8 / FP4 weights
    tokens = torch.randint(0, cfg["vocab_size"], (1, PROMPT + 1),
                           generator=torch.Generator().manual_seed(1))
    ours_fht = ours_mod.__deepseek_csa_kernels__.fast_hadamard_transform

    def step(model, fht):
        def run():
            old = sys.modules.get("fast_hadamard_transform")
            sys.modules["fast_hadamard_transform"] = fht
            try:
                with _Default(torch.bfloat16):
                    return model(tokens[:, PROMPT:PROMPT + 1], PROMPT)
            finally:
                sys.modules["fast_hadamard_transform"] = old
        return run

    for model, fht in ((ours, ours_fht), (sa, sa_mods["fast_hadamard_transform"])):
        old = sys.modules.get("fast_hadamard_transform")
        sys.modules["fast_hadamard_transform"] = fht
        with _Default(torch.bfloat16):
            model(tokens[:, :PROMPT], 0)               # the prompt fills the window cache
        sys.modules["fast_hadamard_transform"] = old
    o, s = step(ours, ours_fht)(), step(sa, sa_mods["fast_hadamard_transform"])()
    rel = float((o.float() - s.float()).norm() / s.float().norm())
    return cfg, ours, sa, step(ours, ours_fht), step(sa, sa_mods["fast_hadamard_transform"]), rel


def cases(quick=False):
    cfg, ours, sa, f_ours, f_sa, rel = build(quick)
    wb = weight_bytes(ours)
    return [harness.Case(
        "model_py", f"V4-Flash-width layer decode step, FP8/FP4 weights ({wb / 2**20:.0f} MiB)"
        + (" [quick]" if quick else ""),
        ours=f_ours, eager=f_sa, bytes=wb, bound="memory", reps=5)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--isa", choices=["base", "avx2", "avx512", "amx"])
    a = ap.parse_args()
    if a.isa:
        os.environ["DEEPSEEK_CSA_ISA"] = a.isa
    import deepseek_csa as dc
    if a.isa:
        dc.set_isa(a.isa)
    from threadpoolctl import threadpool_limits
    torch.set_num_threads(a.threads)
    with threadpool_limits(a.threads, user_api="openmp"):
        peaks = harness.machine_peaks(a.threads)
        cfg, ours, sa, f_ours, f_sa, rel = build(a.quick)
        wb = weight_bytes(ours)
        f32b = sum(p.numel() * (8 if p.dtype == torch.float4_e2m1fn_x2 else 4)
                   for p in ours.parameters())
        times = harness.interleaved_times({"ours": f_ours, "standin": f_sa}, a.reps)
        import statistics
        t_o, t_s = statistics.median(times["ours"]), statistics.median(times["standin"])
        ratio = statistics.median([s / o for s, o in zip(times["standin"], times["ours"])])
        mem_o, mem_s = harness.peak_extra_rss(f_ours), harness.peak_extra_rss(f_sa)
    row = {"case": "one V4-Flash-width layer, decode step at position 16 (batch 1)",
           "config": cfg, "isa": dc.get_isa(), "cpu": harness.cpu_model(), "threads": a.threads,
           "ours_s": t_o, "standin_s": t_s, "speedup_vs_standin": ratio,
           "ours_step_peak_mem_bytes": mem_o, "standin_step_peak_mem_bytes": mem_s,
           "weight_bytes_fp8_fp4": wb, "weight_bytes_as_float32": f32b,
           "weight_gbs_ours": wb / t_o / 1e9, "frac_stream_ours": wb / t_o / 1e9 / peaks["stream_gbs"],
           "rel_diff_vs_standin": rel, "reps": a.reps, "times": times}
    out = {"note": "ours: the package's kernel module (fp8_gemm / fp4_gemm on the FP8 / FP4 bytes); "
                   "standin: float32 torch stand-ins decoding the same codes each call; "
                   "medians of interleaved rounds; peak memory = resident high-water mark "
                   "above the start of one step",
           "machine": peaks, "env": harness.environment(a.threads), "rows": [row]}
    harness.RESULTS.mkdir(exist_ok=True)
    (harness.RESULTS / "model_py.json").write_text(json.dumps(out, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(9, 4))
    ax[0].bar(["deepseek_csa", "float32 stand-ins"], [1e3 * t_o, 1e3 * t_s], color=["tab:green", "tab:gray"])
    ax[0].set_ylabel("decode step (ms)")
    ax[0].set_title(f"x{ratio:.1f}, {a.threads} threads, {dc.get_isa()}")
    ax[1].bar(["step peak\nours", "step peak\nstand-ins", "weights\nFP8/FP4", "weights\nas float32"],
              [mem_o / 2**20, mem_s / 2**20, wb / 2**20, f32b / 2**20],
              color=["tab:green", "tab:gray", "tab:green", "tab:gray"])
    ax[1].set_ylabel("MiB")
    fig.suptitle("one V4-Flash-width layer via load_model_py (tests/tiny_model/model.py)", fontsize=9)
    fig.tight_layout()
    fig.savefig(harness.RESULTS / "model_py.png", dpi=110)
    print(json.dumps({k: v for k, v in row.items() if k not in ("times", "config")}, indent=1))


if __name__ == "__main__":
    main()
