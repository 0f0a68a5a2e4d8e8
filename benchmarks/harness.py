"""Benchmark harness: machine ceilings, then each case against torch eager and
torch.compile of the same reference, in one run.

A benchmark module `benchmarks/bench_<concern>.py` defines `cases(quick: bool)`
returning a list of `Case`.  `run.py` discovers them, times every side, and writes
benchmarks/results/results.json and results.png.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

# CSA_BENCH_RESULTS=/some/dir (or run.py --results) keeps a run out of the snapshot.
RESULTS = Path(os.environ.get("CSA_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


@dataclasses.dataclass
class Case:
    """One benchmark.

    ours:    zero-argument callable running our kernel on prepared inputs.
    eager:   zero-argument callable running the torch eager reference on the same inputs.
    compile_fn, compile_args: the torch function eager calls and its arguments, so the
             harness can torch.compile it (None to skip).
    bytes:   bytes a kernel must move at least (for GB/s and the bandwidth fraction).
    flops:   floating-point operations (for GFLOP/s and the FMA-peak fraction).
    bound:   "memory", "compute" (fp32 FMA) or "compute_bf16" (AMX-BF16 tiles where the
             CPU has them, else fp32 FMA): which ceiling the fraction of peak is taken of.
    """
    kernel: str
    name: str
    ours: Callable[[], object]
    eager: Optional[Callable[[], object]] = None
    compile_fn: Optional[Callable] = None
    compile_args: tuple = ()
    bytes: float = 0.0
    flops: float = 0.0
    bound: str = "memory"
    reps: int = 0          # 0: as many as fit in ~1.5 s, at least 3


_WAKE = None


def wake_threads():
    """One tiny parallel region on the OpenMP pool (the package and torch share one
    runtime), untimed, before each timed call: a side must not start by waking threads
    that went to sleep during the previous, slower side.  On the 2-vCPU test VM that
    wake-up alone cost 1-3 ms (docs/runner.md, Threads), more than a whole decode call;
    an application calling kernels back to back never pays it."""
    global _WAKE
    import torch
    from deepseek_csa import _core
    if _WAKE is None:
        _WAKE = [np.zeros(64, np.float32) for _ in range(3)]
    _core._stream_triad(*_WAKE, torch.get_num_threads())


def _involuntary_switches() -> int:
    """Involuntary context switches of this process so far, all its threads (getrusage)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def interleaved_times(sides: dict, reps=0, budget=1.5, switches=None, min_clean=0,
                      max_seconds=0.0) -> dict:
    """Times every side (name -> zero-argument callable) in rounds, one call of each side
    per round, in alternating order, so that a machine whose speed drifts (other
    tenants, frequency) slows every side alike; returns name -> list of seconds.
    Every timed call starts with the threads awake (wake_threads).
    Rounds: `reps`, or as many as fit in about `budget` seconds per side (3..200).

    switches: a dict to fill with name -> involuntary context switches of the process
    (any of its threads) during each timed call: a call with one was descheduled for a
    while, and its time is partly another tenant's.  min_clean: with `switches`, go on
    past the rounds above until that many rounds had no such switch in any call, or
    until max_seconds have passed since the first timed round."""
    for fn in sides.values():
        fn()  # warm up (first touch, caches, lazy init)
    one = 0.0
    for fn in sides.values():
        t0 = time.perf_counter()
        fn()
        one = max(one, time.perf_counter() - t0)
    n = reps or max(3, min(200, int(budget / max(one, 1e-6))))
    times = {name: [] for name in sides}
    if switches is not None:
        switches.update({name: [] for name in sides})
    order = list(sides)
    start, r, clean = time.perf_counter(), 0, 0
    while r < n or (switches is not None and clean < min_clean and
                    time.perf_counter() - start < max_seconds):
        quiet = True
        for name in (order if r % 2 == 0 else order[::-1]):
            wake_threads()
            s0 = _involuntary_switches() if switches is not None else 0
            t0 = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - t0)
            if switches is not None:
                sw = _involuntary_switches() - s0
                switches[name].append(sw)
                quiet = quiet and sw == 0
        clean += switches is not None and quiet
        r += 1
    return times


def peak_extra_rss(fn):
    """Peak resident memory above the starting point while fn runs (bytes), from the
    kernel's high-water mark after resetting it (/proc/self/clear_refs)."""

    def field(name):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name):
                    return int(line.split()[1]) * 1024
        return 0

    # freed heap memory goes back to the system first: glibc keeps large freed blocks in
    # the heap once its mmap threshold has grown, so a kernel's scratch reused from an
    # earlier call raised no high-water mark (sparse_attn_backward read 0.0 MiB)
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    base = field("VmRSS:")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return float("nan")
    fn()
    return max(0, field("VmHWM:") - base)


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo, sysctl on macOS), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        import subprocess
        r = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                           text=True, timeout=5)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def machine_peaks(threads: int, refresh=False) -> dict:
    """Ceilings at the ISA level in use (deepseek_csa.get_isa(): a capped level gets the
    ceilings of its own vectors): fp32 FMA peak (GFLOP/s, the level's vector width and
    accumulator count, see csrc/peak_impl.h), AMX-BF16 peak (None where the level or the
    CPU has no AMX) and STREAM triad bandwidth (GB/s) on `threads` threads, measured with
    our own micro-kernels and cached per host, CPU model, thread count and level."""
    from deepseek_csa import _core
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "peaks.json"
    cache = json.loads(path.read_text()) if path.exists() else {}
    isa = _core.get_isa()
    # host names repeat across VMs ("vm"): the CPU model is part of the key
    key = f"{platform.node()}:{cpu_model()}:{threads}:{isa}"
    if key in cache and "fma_shape" in cache[key] and not refresh:
        return cache[key]
    shape = _core._peak_fma_shape()
    best = 0.0
    iters = 20_000_000 if isa != "ref" else 200_000_000
    for _ in range(5):
        t0 = time.perf_counter()
        flops = _core._peak_fma(iters, threads)
        best = max(best, flops / (time.perf_counter() - t0) / 1e9)
    amx = None
    for _ in range(5):
        t0 = time.perf_counter()
        flops = _core._peak_amx_bf16(2_000_000, threads)
        if flops is None:
            break
        amx = max(amx or 0.0, flops / (time.perf_counter() - t0) / 1e9)
    bw = stream_triad_gbs(threads)
    cache[key] = {"fma_gflops": best, "stream_gbs": bw, "amx_bf16_gflops": amx,
                  "threads": threads, "isa": isa, "cpu": cpu_model(),
                  "fma_shape": {"vec_bytes": shape["vec_bytes"],
                                "accumulators": shape["accumulators"]}}
    path.write_text(json.dumps(cache, indent=1))
    return cache[key]


def stream_triad_gbs(threads: int, reps=5) -> float:
    """STREAM triad bandwidth (GB/s, best of `reps`): a[i] = b[i] + s c[i] in our C
    micro-kernel on `threads` threads over 3 x 384 MiB float32 -- beyond the caches (this
    VM reports a 300 MiB L3) -- counting 12 bytes an element as STREAM does."""
    from deepseek_csa import _core
    n = 96 * 1024 * 1024
    a = np.zeros(n, np.float32)
    b = np.ones(n, np.float32)
    c = np.ones(n, np.float32)
    _core._stream_triad(a, b, c, threads)      # first touch of a outside the timing
    bw = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        _core._stream_triad(a, b, c, threads)
        bw = max(bw, 3 * 4 * n / (time.perf_counter() - t0) / 1e9)
    return bw


def read_gbs(nbytes: int, threads: int, reps=7, cold=True) -> float:
    """A read-only stream over `nbytes` of float32 in our C micro-kernel (_stream_read:
    each thread sums one contiguous share), `threads` threads, median of `reps` in GB/s;
    cold: a 512 MiB read between calls evicts the buffer from the L3 first.  What a
    decode GEMV reading those bytes once could reach (torch.sum, the probe before it,
    read 34 MB cold at 25 GB/s where this reads 34-38 on the same host)."""
    import statistics
    from deepseek_csa import _core
    a = np.ones(nbytes // 4, np.float32)
    sweep = np.ones(128 << 20, np.float32) if cold else None
    ts = []
    for _ in range(reps):
        if cold:
            _core._stream_read(sweep, threads)
        t0 = time.perf_counter()
        _core._stream_read(a, threads)
        ts.append(time.perf_counter() - t0)
    return a.nbytes / statistics.median(ts) / 1e9


def compute_peak(bound: str, peaks: dict):
    """(GFLOP/s, label) of the ceiling a compute-bound row is a fraction of: AMX-BF16
    for bf16 work where the level in use has the tiles, else the level's fp32 FMA peak."""
    if bound == "compute_bf16" and peaks.get("amx_bf16_gflops"):
        return peaks["amx_bf16_gflops"], "amx_bf16"
    return peaks["fma_gflops"], f"fma_{peaks['isa']}"


def run_case(case: Case, peaks: dict, do_compile=True) -> dict:
    """Times ours, eager and torch.compile interleaved: each time is a median over the
    rounds, each speed-up the median of the per-round ratios."""
    import torch
    import deepseek_csa as dc
    row = {"kernel": case.kernel, "case": case.name, "isa": dc.get_isa(), "cpu": cpu_model(),
           "threads": peaks.get("threads"), "bytes": case.bytes, "flops": case.flops,
           "bound": case.bound}
    sides = {"ours": case.ours}
    if case.eager is not None:
        sides["eager"] = case.eager
    if do_compile and case.compile_fn is not None:
        try:
            cf = torch.compile(case.compile_fn, dynamic=False)
            sides["compile"] = lambda: cf(*case.compile_args)
            sides["compile"]()
        except Exception as e:  # report, do not hide, a compile failure
            sides.pop("compile", None)
            row["compile_error"] = f"{type(e).__name__}: {e}"[:300]
    times = interleaved_times(sides, case.reps)
    t = statistics.median(times["ours"])
    row["ours_s"] = t
    row["ours_peak_mem_bytes"] = peak_extra_rss(case.ours)
    for name, key in (("eager", "eager"), ("compile", "compile")):
        if name in times:
            row[f"{key}_s"] = statistics.median(times[name])
            row[f"{key}_peak_mem_bytes"] = peak_extra_rss(sides[name])
            row[f"speedup_vs_{key}"] = statistics.median(
                [o / u for o, u in zip(times[name], times["ours"])])
    if case.bytes:
        row["gbs"] = case.bytes / t / 1e9
        row["frac_stream"] = row["gbs"] / peaks["stream_gbs"]
    if case.flops:
        row["gflops"] = case.flops / t / 1e9
        peak, label = compute_peak(case.bound, peaks)
        row["peak_used"] = label
        row["peak_gflops"] = peak
        row["frac_fma_peak"] = row["gflops"] / peak
    return row


def fmt_row(r: dict) -> str:
    parts = [f"{r['kernel']:<14} {r['case']:<38} {r.get('isa', '?'):<6} {r['ours_s'] * 1e3:9.3f} ms"]
    if "speedup_vs_eager" in r:
        parts.append(f"x{r['speedup_vs_eager']:6.2f} eager")
    if "speedup_vs_compile" in r:
        parts.append(f"x{r['speedup_vs_compile']:6.2f} compile")
    elif "compile_error" in r:
        parts.append("compile failed")
    if "gbs" in r and r["bound"] == "memory":
        parts.append(f"{r['gbs']:7.1f} GB/s ({100 * r['frac_stream']:4.0f}% stream)")
    if "gflops" in r:
        used = r.get("peak_used") or ("amx_bf16" if r["bound"] == "compute_bf16" else "fma")
        peak = "AMX peak" if used == "amx_bf16" else f"{used.replace('fma_', '')} FMA peak"
        parts.append(f"{r['gflops']:7.1f} GFLOP/s ({100 * r['frac_fma_peak']:4.0f}% {peak})")
    parts.append(f"mem {r['ours_peak_mem_bytes'] / 2**20:7.1f} MiB")
    return "  ".join(parts)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    several = len({r.get("isa") for r in rows}) > 1
    labels = [f"{r['kernel']}\n{r['case']}" + (f" [{r.get('isa')}]" if several else "")
              for r in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(rows)), 9))
    se = [r.get("speedup_vs_eager", 0) for r in rows]
    sc = [r.get("speedup_vs_compile", 0) for r in rows]
    axes[0].bar(x - 0.2, se, 0.4, label="vs torch eager")
    axes[0].bar(x + 0.2, sc, 0.4, label="vs torch.compile")
    axes[0].axhline(1, color="k", lw=0.8)
    axes[0].set_ylabel("speed-up (x)")
    axes[0].set_yscale("log")
    axes[0].legend()
    frac = [100 * (r.get("frac_fma_peak") if r["bound"].startswith("compute")
                   else r.get("frac_stream", 0)) for r in rows]
    colour = {"compute": "tab:red", "compute_bf16": "tab:purple", "memory": "tab:green"}
    axes[1].bar(x, frac, 0.5, color=[colour.get(r["bound"], "tab:gray") for r in rows])
    axes[1].set_ylabel("% of the peak of the ISA level in use\n(green: stream BW, red: fp32 FMA,\n"
                       "purple: AMX bf16, or FMA without AMX)")
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment(threads):
    import torch
    import deepseek_csa as dc
    info = dc.build_info()
    return {"threads": threads, "isa": dc.get_isa(), "best_isa": dc.best_isa(),
            "torch": torch.__version__, "numpy": np.__version__, "cpu": cpu_model(),
            "arch": platform.machine(), "openmp": info["openmp"],
            "compiler": info["compiler"], "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "deepseek_csa_isa": os.environ.get("DEEPSEEK_CSA_ISA")}
