"""The CPU runner (python -m deepseek_csa.generate) end to end, in subprocesses.

1. Speed: a decisive V4-Flash-width stack of tests/tiny_model/model.py (dim 4096, 64
   heads of 512, q_lora 1024, FP8 dense linears, FP4 experts, every layer hash-routed,
   a planted next-token head) written in convert.py's layout for 1 and 2 ranks; runs of
   1 process x 2 threads and `torchrun --nproc-per-node 2` x 1 thread are interleaved
   (A B A B ...); the tokens must agree; tokens/s of both.
2. Memory: a larger checkpoint of the same model (1 rank), loaded and run once;
   peak RSS (ru_maxrss) against the shard's bytes on disk, with the RSS of the
   interpreter + torch + deepseek_csa before model.py is loaded reported separately.

    .venv/bin/python benchmarks/bench_generate.py [--reps 2] [--mem-layers 8] [--tmp /tmp/x]

Writes benchmarks/results/generate.json (or $CSA_BENCH_RESULTS/generate.json).  Not a
harness.py case: each side is a whole process (load, prefill, decode).
"""
import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "tiny_model"
RESULTS = Path(os.environ.get("CSA_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")

FLASH = dict(vocab_size=4096, dim=4096, n_heads=64, head_dim=512, rope_head_dim=64,
             q_lora_rank=1024, window_size=128, n_routed_experts=8, n_activated_experts=2,
             moe_inter_dim=2048, hc_mult=4, max_batch_size=1, max_seq_len=256,
             dtype="fp8", expert_dtype="fp4", scale_fmt="ue8m0")


def planted_next(v, vocab):
    return (v * 7 + 3) % vocab


def build_state(cfg, seed=0):
    """Random FP8 / FP4 weights made straight in their formats (no float32 copy of a
    whole matrix), hash routing and a planted next-token head."""
    sys.path.insert(0, str(ROOT))
    import deepseek_csa.torch as dct
    mod = dct.load_model_py(TINY)
    torch.set_default_dtype(torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    model = mod.Transformer(mod.ModelArgs(**cfg))
    vocab, dim, ne, topk = cfg["vocab_size"], cfg["dim"], cfg["n_routed_experts"], cfg["n_activated_experts"]
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, mod.Linear):
                k = m.in_features
                if m.weight.dtype == torch.float8_e4m3fn:
                    for i in range(0, m.weight.shape[0], 1024):   # row chunks
                        blk = torch.randn(min(1024, m.weight.shape[0] - i), k, generator=g)
                        m.weight[i:i + blk.shape[0]] = (blk * (64 * k ** -0.5)).to(torch.float8_e4m3fn)
                    m.scale.view(torch.uint8).fill_(127 - 6)       # 2^-6
                elif m.weight.dtype == torch.float4_e2m1fn_x2:
                    m.weight.view(torch.uint8).copy_(torch.randint(
                        0, 256, m.weight.shape, generator=g, dtype=torch.uint8))
                    e = 127 + round(__import__("math").log2(k ** -0.5 / 3))
                    m.scale.view(torch.uint8).copy_(torch.randint(
                        e - 1, e + 2, m.scale.shape, generator=g, dtype=torch.uint8))
        for name, p in model.named_parameters():
            if p.dtype in (torch.float8_e4m3fn, torch.float4_e2m1fn_x2, torch.float8_e8m0fnu):
                continue
            if name.endswith("tid2eid"):
                p.copy_(torch.stack([torch.randperm(ne, generator=g)[:topk]
                                     for _ in range(vocab)]).to(torch.int32))
            elif name.endswith("norm.weight") or ("hc_" in name and name.endswith("scale")):
                p.copy_((1 + 0.1 * torch.randn(p.shape, generator=g)).to(p.dtype))
            elif "_fn" in name:
                p.copy_((0.5 * torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5).to(p.dtype))
            elif name.endswith("gate"):
                p.copy_((torch.randn(p.shape, generator=g) * dim ** -0.5).to(p.dtype))
            elif name.endswith("base") or name.endswith("attn_sink"):
                p.copy_((0.3 * torch.randn(p.shape, generator=g)).to(p.dtype))
        e = torch.randn(vocab, dim, generator=g)
        model.embed.weight.copy_(e.to(torch.bfloat16))
        head = torch.zeros(vocab, dim)
        head[[planted_next(t, vocab) for t in range(vocab)]] = e / e.norm(dim=-1, keepdim=True)
        model.head.copy_(4 * head)
    return {k: v.detach() for k, v in model.state_dict().items()}


def write_ckpt(cfg, root, worlds):
    """In a child process, so that this one stays small (a child inherits ru_maxrss,
    and the host's memory is shared)."""
    subprocess.run([sys.executable, __file__, "--write", json.dumps(cfg), str(root),
                    ",".join(map(str, worlds))], check=True, cwd=ROOT,
                   env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _write_ckpt(cfg, root, worlds):
    import importlib.util
    from safetensors.torch import save_file
    spec = importlib.util.spec_from_file_location("tiny_model_shard", TINY / "shard.py")
    layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout)
    shard = layout.shard          # convert.py's split, as the tests write it
    state = build_state(cfg)
    root.mkdir(parents=True, exist_ok=True)
    for w in worlds:
        d = root / f"mp{w}"
        d.mkdir(exist_ok=True)
        for r in range(w):
            save_file({k: v.contiguous() for k, v in shard(state, r, w, cfg["n_routed_experts"]).items()},
                      str(d / f"model{r}-mp{w}.safetensors"))
    (root / "config.json").write_text(json.dumps(cfg))


def _cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(root, world, threads, prompt, new, env_extra=None):
    (root / "prompt.txt").write_text(" ".join(map(str, prompt)))
    out = root / f"out-{world}-{threads}.json"
    cmd = [sys.executable]
    if world > 1:
        cmd += ["-m", "torch.distributed.run", "--nproc-per-node", str(world),
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cmd += ["-m", "deepseek_csa.generate", "--inference-dir", str(TINY), "--ckpt-path",
            str(root / f"mp{world}"), "--config", str(root / "config.json"), "--input-file",
            str(root / "prompt.txt"), "--max-new-tokens", str(new), "--output-json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT), **(env_extra or {}))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if p.returncode:
        raise RuntimeError(p.stdout[-2000:] + p.stderr[-2000:])
    res = json.loads(out.read_text())
    res["wall_s"] = time.perf_counter() - t0
    return res


def main():
    if sys.argv[1:2] == ["--write"]:
        return _write_ckpt(json.loads(sys.argv[2]), Path(sys.argv[3]),
                           [int(w) for w in sys.argv[4].split(",")])
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mem-layers", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--tmp", default="/tmp/bench_generate")
    ap.add_argument("--part", choices=("both", "speed", "memory"), default="both",
                    help="run one part; the other is kept from an existing generate.json")
    a = ap.parse_args()
    tmp = Path(a.tmp)
    cfg = dict(FLASH, n_layers=a.layers, n_hash_layers=a.layers)
    prompt = [(i * 37 + 11) % cfg["vocab_size"] for i in range(a.prompt_len)]
    want = [planted_next(prompt[-1], cfg["vocab_size"])]
    while len(want) < a.new:
        want.append(planted_next(want[-1], cfg["vocab_size"]))
    result = {"cpu": _cpu_name(), "threads_note": "1 process x 2 threads vs 2 processes x 1 thread",
              "isa": os.environ.get("DEEPSEEK_CSA_ISA", "auto (avx2 on this host)"),
              "config": cfg, "prompt_len": a.prompt_len, "new_tokens": a.new}
    old = RESULTS / "generate.json"
    if a.part != "both" and old.exists():
        prev = json.loads(old.read_text())
        for k in ("speed", "memory"):
            if k in prev and k != a.part:
                result[k] = prev[k]
    try:
        if a.part in ("both", "speed"):
            write_ckpt(cfg, tmp / "speed", (1, 2))
            # OMP_WAIT_POLICY=passive: on a host whose cores other jobs also use, spinning
            # OpenMP threads wait for a descheduled peer (measured 1.0 vs 3.9 tokens/s)
            sides = {"1proc_x_2threads": (1, 2, {}), "2procs_x_1thread": (2, 1, {}),
                     "1proc_x_2threads_passive": (1, 2, {"OMP_WAIT_POLICY": "passive"})}
            runs = {k: [] for k in sides}
            for _ in range(a.reps):
                for k, (w, t, e) in sides.items():
                    runs[k].append(run(tmp / "speed", w, t, prompt, a.new, e))
            toks = {k: [r["tokens"] for r in v] for k, v in runs.items()}
            same = all(t == [want] for v in toks.values() for t in v)
            result["speed"] = {
                k: {"rss_python_torch_baseline_per_rank": [[x["rss_before_model"] for x in r["ranks"]] for r in v],
                    "decode_tokens_per_s": [r["decode_tokens_per_s"] for r in v],
                    "prefill_tokens_per_s": [r["prefill_tokens_per_s"] for r in v],
                    "peak_rss_per_rank": [[x["peak_rss"] for x in r["ranks"]] for r in v],
                    "shard_bytes": [x["shard_bytes"] for x in v[0]["ranks"]]}
                for k, v in runs.items()}
            best = {k: max(v["decode_tokens_per_s"]) for k, v in result["speed"].items()}
            result["speed"]["same_tokens_as_planted"] = same
            result["speed"]["decode_ratio_2procs_over_1proc"] = best["2procs_x_1thread"] / best["1proc_x_2threads"]
            result["speed"]["decode_ratio_2procs_over_1proc_passive"] = (
                best["2procs_x_1thread"] / best["1proc_x_2threads_passive"])
            result["speed"]["host_load_avg_1min"] = os.getloadavg()[0]
            print(json.dumps(result["speed"], indent=1))
            shutil.rmtree(tmp / "speed")
        if a.part in ("both", "memory"):
            mcfg = dict(FLASH, n_layers=a.mem_layers, n_hash_layers=a.mem_layers)
            write_ckpt(mcfg, tmp / "mem", (1,))
            r = run(tmp / "mem", 1, 2, prompt, 4)
            rk = r["ranks"][0]
            result["memory"] = {
                "n_layers": a.mem_layers, "shard_bytes": rk["shard_bytes"],
                "peak_rss": rk["peak_rss"], "rss_python_torch_baseline": rk["rss_before_model"],
                "peak_over_disk": rk["peak_rss"] / rk["shard_bytes"],
                "peak_minus_baseline_over_disk": (rk["peak_rss"] - rk["rss_before_model"]) / rk["shard_bytes"],
                "tokens_match_planted": r["tokens"][0] == want[:4],
                "what": "1 process x 2 threads loads the 1-rank shard and generates 4 tokens; "
                        "peak_rss = VmHWM of that process (load + prefill + decode); baseline = "
                        "VmRSS after importing torch + deepseek_csa, before model.py",
                "decode_tokens_per_s": r["decode_tokens_per_s"]}
            print(json.dumps(result["memory"], indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "generate.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
