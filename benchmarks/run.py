"""Runs every benchmarks/bench_*.py case against torch eager and torch.compile.

    python benchmarks/run.py                 # all cases, 2 threads
    python benchmarks/run.py -k rms_norm     # cases whose kernel or name contains a word
    python benchmarks/run.py --quick --no-compile

Writes benchmarks/results/results.json (merged by case) and results.png.
"""
import argparse
import importlib.util
import json
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
    a = ap.parse_args()

    import torch
    from threadpoolctl import threadpool_limits
    torch.set_num_threads(a.threads)
    with threadpool_limits(a.threads, user_api="openmp"):
        peaks = harness.machine_peaks(a.threads, refresh=a.refresh_peaks)
        print(f"machine: fp32 FMA peak {peaks['fma_gflops']:.1f} GFLOP/s, AMX bf16 peak "
              f"{peaks['amx_bf16_gflops']:.1f} GFLOP/s, stream triad "
              f"{peaks['stream_gbs']:.1f} GB/s on {a.threads} threads ({peaks['isa']})")
        rows = []
        for path in sorted(HERE.glob("bench_*.py")):
            spec = importlib.util.spec_from_file_location(path.stem, path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
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
    merged = {(r["kernel"], r["case"]): r for r in old.get("rows", [])}
    merged.update({(r["kernel"], r["case"]): r for r in rows})
    allrows = sorted(merged.values(), key=lambda r: (r["kernel"], r["case"]))
    out.write_text(json.dumps({"machine": peaks, "env": harness.environment(a.threads),
                               "rows": allrows}, indent=1))
    harness.plot(allrows, harness.RESULTS / "results.png")
    print(f"wrote {out} and results.png")


if __name__ == "__main__":
    main()
