"""Runs every benchmarks/bench_*.py case against torch eager and torch.compile.

    python benchmarks/run.py                 # all cases, 2 threads
    python benchmarks/run.py -k rms_norm     # cases whose kernel or name contains a word
    python benchmarks/run.py --quick --no-compile
    python benchmarks/run.py --isa avx2      # cap the level: one table per level, side by side

Every row carries the ISA level it ran at and the CPU model; "% of peak" is taken of
the ceilings of that level (its FMA vector width; AMX only at level amx), measured at
the start of the run.  Writes benchmarks/results/results.json (rows merged by kernel,
case and level; the peaks of every level measured so far under "machines") and
results.png.
"""
import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("-k", action="append", default=[], help="keep cases matching this word")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--refresh-peaks", action="store_true")
    ap.add_argument("--isa", choices=["ref", "base", "avx2", "avx512", "amx"],
                    help="cap the ISA level (sets DEEPSEEK_CSA_ISA and deepseek_csa.set_isa); "
                         "an error if this CPU lacks it")
    ap.add_argument("--results", help="write JSON + PNG (and the peaks cache) here instead "
                                      "of benchmarks/results")
    a = ap.parse_args()
    if a.results:
        harness.RESULTS = Path(a.results).resolve()
    if a.isa:
        os.environ["DEEPSEEK_CSA_ISA"] = a.isa   # before the first import, and for children
    import deepseek_csa as dc
    if a.isa:
        got = dc.set_isa(a.isa)
        if got != a.isa:
            ap.error(f"--isa {a.isa}: this CPU's best level is {dc.best_isa()}")

    import torch
    from threadpoolctl import threadpool_limits
    torch.set_num_threads(a.threads)
    with threadpool_limits(a.threads, user_api="openmp"):
        peaks = harness.machine_peaks(a.threads, refresh=a.refresh_peaks)
        amx = peaks["amx_bf16_gflops"]
        shape = peaks["fma_shape"]
        print(f"machine: {peaks['cpu']}, ISA level {peaks['isa']} (best {dc.best_isa()}): "
              f"fp32 FMA peak {peaks['fma_gflops']:.1f} GFLOP/s ({shape['accumulators']} x "
              f"{shape['vec_bytes']} B accumulators), AMX bf16 peak "
              + (f"{amx:.1f} GFLOP/s" if amx else "none")
              + f", stream triad {peaks['stream_gbs']:.1f} GB/s on {a.threads} threads")
        rows = []
        for path in sorted(HERE.glob("bench_*.py")):
            spec = importlib.util.spec_from_file_location(path.stem, path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            if not hasattr(mod, "cases"):   # a standalone bench (bench_hf.py): run it itself
                continue
            for case in mod.cases(a.quick):
                if a.k and not any(w in case.kernel or w in case.name for w in a.k):
                    continue
                row = harness.run_case(case, peaks, do_compile=not a.no_compile)
                print(harness.fmt_row(row), flush=True)
                rows.append(row)
                del case
    harness.RESULTS.mkdir(exist_ok=True)
    out = harness.RESULTS / "results.json"
    old = json.loads(out.read_text()) if out.exists() else {}
    old_env = old.get("env", {})
    for r in old.get("rows", []):   # snapshots from before rows carried their level
        r.setdefault("isa", old_env.get("isa"))
        r.setdefault("cpu", old_env.get("cpu"))
    key = lambda r: (r["kernel"], r["case"], r["isa"] or "")  # noqa: E731
    merged = {key(r): r for r in old.get("rows", [])}
    merged.update({key(r): r for r in rows})
    allrows = sorted(merged.values(), key=key)
    machines = dict(old.get("machines", {}))
    if "machine" in old and "machines" not in old:
        m = old["machine"]
        machines[f"{m.get('isa')}:{m.get('threads')}"] = m
    machines[f"{peaks['isa']}:{a.threads}"] = peaks
    out.write_text(json.dumps({"machine": peaks, "machines": machines,
                               "env": harness.environment(a.threads), "rows": allrows},
                              indent=1))
    harness.plot(allrows, harness.RESULTS / "results.png")
    print(f"wrote {out} and results.png")


if __name__ == "__main__":
    main()
