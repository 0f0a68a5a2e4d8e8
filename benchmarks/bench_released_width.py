"""Decode at V4-Flash's released width, where memory bandwidth is the limit (issue 44
item 4): ONE V4-Flash layer with every one of its weights -- all 256 routed FP4 experts,
the FP8 shared expert, the FP8 attention / indexer projections, the compressors -- in
the released layouts, random values, run by our runner's code path (DeepSeek's released
inference/model.py on deepseek_csa's kernel module, the checkpoint made by its own
convert.py) and by llama.cpp (the GGUF made by its own converter), decoding after 4K
and 64K tokens of context.

    PEERS_EXTRA_TARGETS="llama-bench llama" make peers   # once: libllama + harness
    PEERS_GGML_ISA=noamx make peers                       # once, AMX hosts
    .venv/bin/python benchmarks/bench_released_width.py --prepare   # 3.6 GB model, GGUF,
                                                                    # runner checkpoint
    .venv/bin/python benchmarks/bench_released_width.py --llama-max-ctx 4096
    .venv/bin/python benchmarks/bench_released_width.py --worker components   # where a
                                                        # step's bytes go, each piece cold

Durations (2 cores, loaded host): --prepare ~8 min once (peak ~8 GB resident; cached
under build/peers/width44/<key>/, 10 GB on disk: hf/, ckpt/ and model.gguf 3.4 GiB
each); the timed run ~1 min on a quiet host with --llama-max-ctx 4096 (llama.cpp
prefilled 4096 tokens in 24 s; 266 s on a loaded host), its 65536-token prefill, the
default, much longer.  Every timed decode step starts with the L3 evicted (--l3, see L3
below).

The model (CFG): bench_llamacpp_model.MODEL's V4-Flash widths (hidden 4096, 64 heads x
512, q_lora 1024, 8 x 1024 output groups, window 128, 64 index heads x 128, top-512,
hyper-connections x4) with ONE layer, CSA (ratio 4, the indexer), and V4-Flash's MoE:
256 routed experts of 2048 (6 active, sqrt-softplus scores + a random bias) and the
shared expert; a 512-token vocabulary.  Weights: the FP8 tensors Gaussian (std
1/sqrt(fan-in)) quantized to e4m3 with ue8m0 128x128 blocks as bench_llamacpp_model
writes them; the routed experts' FP4 codes drawn uniformly (every e2m1 value) with ue8m0
scales per 32 that give the same std -- quantizing 6.4 G Gaussian values would take
longer than everything else, and a bandwidth benchmark reads codes, not their
distribution.  Router weight std 1/sqrt(hidden) and bias std 0.1, so the top-6 moves
across the 256 experts from token to token (each side's JSON counts how many distinct
experts our runner's steps used).

Context: our runner's model.py prefills in one call (its start_pos == 0 path); 4096
tokens fit, 65536 do not (its indexer scores alone would be 64 heads x 64K x 16K).  So
after 4K tokens ours decodes both after a real prefill and after a synthetic fill (a
256-token real prefill, then the window, the compressed K/V and the index keys of 4096
positions filled with random values of the prefill's scale, decoding from position
4096); their step times agree (the JSON holds both), and the 64K row is the synthetic
fill at 65536.  llama.cpp always prefills for real (its own chunking), at 4K and 64K.

Per token the JSON counts the bytes each side must read (the released layout: FP8
codes + scales, FP4 codes + scales for the 6 routed experts, bf16 / float32 as stored,
the K/V the step reads) and the bytes our runner actually reads (after DeepSeek's
convert.py: wo_a widened to bf16; model.py's float32 compressors), divides by the step
time and by the STREAM triad measured in the same run (before and after the sides), and
projects the 43-layer V4-Flash: 43 x this layer's step + the 129280-row bf16 head read
at the achieved bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import bench_llamacpp_model as blm  # noqa: E402  (model plan, converter, llama.cpp side)
from bench_llamacpp import PEERS  # noqa: E402

CFG = dict(blm.MODEL, num_hidden_layers=1, compress_ratios=[4], n_routed_experts=256,
           num_hash_layers=0)
SEED = 44
# our runner's wo_a: "fp8" (deepseek_csa.generate's default: convert.py's bf16 widening
# requantized exactly, a weight-only FP8 GEMV at decode) or "bf16" (model.py's einsum)
WO_A = "fp8"
# and its float32 weights with bf16 values (compressors, head): "bf16" (the runner's
# default, --f32-weights) or "f32" (as released)
F32W = "bf16"
# and its MoE: "fused" (the runner's default, --moe: the routed experts in three fp4_gemm
# calls, the released loop's bits) or "loop" (model.py's MoE.forward)
MOE = "fused"
# and its indexer at decode: "fused" (the runner's default, --indexer: the FP4 kernel with
# the released bf16 roundings, the released selection) or "einsum" (model.py's as released)
INDEXER = "fused"
# the L3 before each timed decode step: "cold" (an untimed 512 MiB pass evicts it first,
# as each layer of the 43-layer model finds it: the other 42 layers' ~11 GB went through
# since) or "warm" (consecutive steps of this one layer: part of its ~130 MB of
# attention weights and shared expert stays in the VM's 300 MiB L3 from the last step).
# Measured, our runner after the synthetic 4K fill (Sapphire Rapids, 2 threads, quiet
# host): warm 10.25 ms, cold 12.25 (docs/peers.md section 9); llama.cpp 25.6 / 25.5.
L3 = "cold"
SWEEP_MIB = 512
CACHE = PEERS / "width44"
MAX_CTX = 65536
# V4-Flash as released: 43 layers and a 129280-token bf16 head (the projection's extra bytes)
FLASH_LAYERS = 43
FLASH_VOCAB = 129280
PUBLIC = dict(tokens_per_s=9.7, engine="llama.cpp", cpu="32-core AMD EPYC",
              what="the public V4-Flash CPU decode report the issue cites")


def inference_dir():
    """DeepSeek's released V4 inference/ (model.py, convert.py), where the tests find it
    (tests/released_files.py: beside the checkout, or DEEPSEEK_MODEL_PY); None when absent."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import released_files as rf
    finally:
        sys.path.remove(str(ROOT / "tests"))
    path, _ = rf._locate(rf.ENV_V4, rf.V4_DEFAULT, "model.py")
    conv, _ = rf._locate(rf.ENV_V4, rf.V4_DEFAULT, "convert.py", "convert.py")
    return Path(path).parent if path and conv else None


def model_dir():
    return CACHE / blm.model_key(dict(CFG, layout="compressors bf16"), SEED, blm.HEAD_GAIN)


def tensor_plan():
    """bench_llamacpp_model's plan of CFG with the compressors' wkv / wgate in bf16, as
    the released checkpoint stores them (model.py keeps them, and the head, in float32)."""
    return [(n, sh, "bf16" if ".compressor.w" in n else fmt, std)
            for n, sh, fmt, std in blm.tensor_plan(CFG)]


# ---------------------------------------------------------------- writing the model
def _fp4_random(rng, shape, std):
    """Uniform e2m1 codes (two a byte, int8 [N, K/2]) and ue8m0 scales [N, K/32] whose
    dequantized values have standard deviation ~std (the e2m1 grid's RMS is 2.93)."""
    import torch
    N, K = shape
    codes = rng.integers(0, 256, size=(N, K // 2), dtype=np.uint8)
    e = int(np.round(np.log2(std / 2.93)))
    sc = (e + 127 + rng.integers(-1, 1, size=(N, K // 32))).astype(np.uint8)
    return (torch.from_numpy(codes.view(np.int8)),
            torch.from_numpy(sc).view(torch.float8_e8m0fnu))


def write_hf(root, log=print):
    """root/hf: the released Hugging Face layout of CFG (one safetensors file)."""
    import torch
    from safetensors.torch import save_file
    hf = root / "hf"
    if (hf / "model.safetensors").exists():
        return hf
    hf.mkdir(parents=True, exist_ok=True)
    blm.write_tokenizer(hf, CFG["vocab_size"])
    (hf / "config.json").write_text(json.dumps(blm.config_json(CFG, True), indent=1))
    rng = np.random.default_rng(SEED)
    t0 = time.time()
    out, formats = {}, {}
    for name, shape, fmt, std in tensor_plan():
        formats[name] = fmt
        if fmt == "fp4":
            q, s = _fp4_random(rng, shape, std)
            out[name], out[name[:-len("weight")] + "scale"] = q, s
            continue
        w = blm.random_weight(rng, shape, std)
        if fmt == "fp8":
            q, s, _ = blm.quant_fp8(w)
            out[name], out[name[:-len("weight")] + "scale"] = q, s
        elif fmt == "bf16":
            out[name] = torch.from_numpy(w).bfloat16()
        else:
            out[name] = torch.from_numpy(w)
    log(f"width44: {len(out)} tensors, {sum(t.numel() * t.element_size() for t in out.values()) / 1e9:.2f} GB "
        f"made in {time.time() - t0:.0f} s")
    save_file(out, str(hf / "model.safetensors.tmp"), metadata={"format": "pt"})
    (hf / "model.safetensors.tmp").rename(hf / "model.safetensors")
    (root / "formats.json").write_text(json.dumps(formats, indent=0))
    log(f"width44: wrote {hf} ({time.time() - t0:.0f} s)")
    return hf


def runner_config():
    """CFG as the released model.py's ModelArgs (its config.json keys)."""
    c = CFG
    return dict(
        max_batch_size=1, max_seq_len=MAX_CTX + 256, dtype="fp8", scale_fmt="ue8m0",
        expert_dtype="fp4", scale_dtype="fp8", vocab_size=c["vocab_size"],
        dim=c["hidden_size"], moe_inter_dim=c["moe_intermediate_size"],
        n_layers=c["num_hidden_layers"], n_hash_layers=c["num_hash_layers"], n_mtp_layers=0,
        n_heads=c["num_attention_heads"], n_routed_experts=c["n_routed_experts"],
        n_shared_experts=1, n_activated_experts=c["num_experts_per_tok"],
        score_func=c["scoring_func"], route_scale=c["routed_scaling_factor"],
        swiglu_limit=c["swiglu_limit"], q_lora_rank=c["q_lora_rank"], head_dim=c["head_dim"],
        rope_head_dim=c["qk_rope_head_dim"], norm_eps=c["rms_norm_eps"],
        o_groups=c["o_groups"], o_lora_rank=c["o_lora_rank"], window_size=c["sliding_window"],
        compress_ratios=c["compress_ratios"], compress_rope_theta=c["compress_rope_theta"],
        original_seq_len=c["rope_scaling"]["original_max_position_embeddings"],
        rope_theta=c["rope_theta"], rope_factor=c["rope_scaling"]["factor"],
        beta_fast=c["rope_scaling"]["beta_fast"], beta_slow=c["rope_scaling"]["beta_slow"],
        index_n_heads=c["index_n_heads"], index_head_dim=c["index_head_dim"],
        index_topk=c["index_topk"], hc_mult=c["hc_mult"],
        hc_sinkhorn_iters=c["hc_sinkhorn_iters"], hc_eps=c["hc_eps"])


def convert_runner(root, log=print):
    """root/ckpt/model0-mp1.safetensors by DeepSeek's convert.py, root/runner.json."""
    ck = root / "ckpt"
    (root / "runner.json").write_text(json.dumps(runner_config(), indent=1))
    if (ck / "model0-mp1.safetensors").exists():
        return ck
    t0 = time.time()
    r = subprocess.run([sys.executable, str(inference_dir() / "convert.py"), "--hf-ckpt-path",
                        str(root / "hf"), "--save-path", str(ck), "--n-experts",
                        str(CFG["n_routed_experts"]), "--model-parallel", "1"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("convert.py failed:\n" + r.stderr[-3000:])
    log(f"width44: {ck} by {inference_dir() / 'convert.py'} ({time.time() - t0:.0f} s)")
    return ck


def prepare(log=print):
    """Model, runner checkpoint and GGUF (cached); FileNotFoundError without `make peers`."""
    if not (blm.LLAMA_TREE / "convert_hf_to_gguf.py").exists():
        raise FileNotFoundError(f"{blm.LLAMA_TREE} not found: run `make peers` first")
    root = model_dir()
    root.mkdir(parents=True, exist_ok=True)
    write_hf(root, log)
    convert_runner(root, log)
    how = blm.convert_gguf(root / "hf", root / "model.gguf", log=log)
    return root, how


# ---------------------------------------------------------------- bytes a step reads
def _fmt_bytes(shape, fmt):
    n = int(np.prod(shape))
    if fmt == "fp8":
        return n + -(-shape[0] // 128) * -(-shape[-1] // 128)      # e4m3 + ue8m0 128x128
    if fmt == "fp4":
        return n // 2 + n // 32                                      # e2m1 + ue8m0 per 32
    return n * {"bf16": 2, "f32": 4, "i32": 4}[fmt]


def _part(name):
    if ".experts." in name:
        return "routed experts (6 of 256)"
    if "shared_experts" in name:
        return "shared expert"
    if "indexer" in name:
        return "indexer"
    if "compressor" in name:
        return "compressor"
    if ".gate." in name:
        return "router"
    if ".attn." in name or "attn_norm" in name or "ffn_norm" in name:
        return "attention"
    if name.startswith("layers."):
        return "hyper-connections"
    return "embed row / head (this model's 512-token vocab)"


def cache_bytes(ctx, dtype_bytes=2):
    """K/V the released model.py's decode step reads at position ctx: the window and the
    top-512 compressed entries (512-wide), and every compressed index key (128-wide)."""
    c = CFG
    n_comp = ctx // 4
    attn = (c["sliding_window"] + min(c["index_topk"], n_comp)) * c["head_dim"] * dtype_bytes
    index = n_comp * c["index_head_dim"] * dtype_bytes
    return {"attention K/V (window + top-512)": attn, "index keys": index}


def must_bytes(ctx):
    """{part: bytes} a decode step must read in the released layout (as written in hf/):
    every tensor of the layer except the routed experts, 6 routed experts, one embedding
    row, the head; plus the caches."""
    out = {}
    E, k = CFG["n_routed_experts"], CFG["num_experts_per_tok"]
    for name, shape, fmt, _ in tensor_plan():
        b = _fmt_bytes(shape, fmt)
        if name == "embed.weight":
            b = b // shape[0]
        if ".experts." in name:
            b = b * k / E
        out[_part(name)] = out.get(_part(name), 0) + b
    out.update(cache_bytes(ctx))
    return out


def flash_head_bytes():
    return FLASH_VOCAB * CFG["hidden_size"] * 2


# ---------------------------------------------------------------- STREAM triad
def triad_gbs(threads, reps=5):
    """Best of `reps` STREAM triads a[i] = b[i] + s c[i] over 3 x 384 MiB float32
    (beyond the 300 MiB L3 this VM reports), `threads` threads; bytes counted as STREAM
    does (3 x 4 per element, no write-allocate)."""
    import harness
    return harness.stream_triad_gbs(threads, reps)


# ---------------------------------------------------------------- our runner's side
def runner_model():
    """(model, its one layer): the released model.py's Transformer of CFG on our kernel
    module with the runner's checkpoint loaded, as deepseek_csa.generate builds it under
    this run's --moe / --wo-a / --f32-weights / --indexer."""
    import torch
    import deepseek_csa.torch as dct
    from deepseek_csa.generate import _rows_hc_post, load_checkpoint, read_config
    root = model_dir()
    torch.set_default_dtype(torch.bfloat16)
    mod = dct.load_model_py(str(inference_dir()))
    _rows_hc_post(mod)                # as deepseek_csa.generate does
    margs, _ = read_config(str(root / "runner.json"), mod.ModelArgs)
    with torch.device("cpu"):
        model = mod.Transformer(margs)
    if MOE == "fused":                # as deepseek_csa.generate does (--moe), before loading
        from deepseek_csa.torch.fused_moe import fuse_moe
        fuse_moe(model)
    load_checkpoint(model, str(root / "ckpt" / "model0-mp1.safetensors"), log=lambda *a: None)
    if WO_A == "fp8":                 # as deepseek_csa.generate does by default (--wo-a)
        from deepseek_csa.torch.checkpoint_width import fp8_wo_a
        fp8_wo_a(model)
    if F32W == "bf16":
        from deepseek_csa.torch.checkpoint_width import bf16_f32_weights
        bf16_f32_weights(model)
    if INDEXER == "fused":
        from deepseek_csa.torch.fused_indexer import fuse_indexer
        fuse_indexer(model)
    return model, model.layers[0]


def synthetic_fill(model, layer, ids, ctx):
    """Prefill ids[:, :256], then the window, the compressed K/V and the index keys of
    ctx positions filled with random values of the prefill's scale (the index keys
    rounded to FP4, as the indexer writes them); the prefill's logits (decoding
    continues from position ctx)."""
    import torch
    import deepseek_csa as dc
    lg = model(ids[:, :256], 0)
    attn = layer.attn
    win, n = attn.window_size, ctx // attn.compress_ratio
    g = torch.Generator().manual_seed(SEED)

    def like(t, rows):
        sd = float(t.float().std())
        return (torch.randn(rows, t.shape[-1], generator=g) * sd).to(t.dtype)
    kv = attn.kv_cache[0]
    kv[:win] = like(kv[:win], win)
    kv[win:win + n] = like(kv[win:win + 64], n)
    ik = attn.indexer.kv_cache[0]
    # index keys as the indexer's compressor writes them: on the FP4 grid (QAT)
    ik[:n] = torch.from_numpy(dc.fp4_round(like(ik[:64], n).float().numpy(), 32)).to(ik.dtype)
    return lg


def runner_worker(ctx, steps, fill, threads, warm=4):
    """One timed run in this (fresh) process of the released model.py on our kernel
    module: load (DeepSeek's convert.py checkpoint, deepseek_csa.generate's loader), warm up
    (64-token prefill + `warm` steps), then fill="real": prefill ctx tokens in one call,
    fill="synthetic": prefill 256, fill the caches to position ctx with random values of
    the prefill's scale; then `steps` greedy steps, each timed.  Prints JSON."""
    import torch
    torch.set_num_threads(threads)
    import deepseek_csa as dc
    from deepseek_csa.generate import peak_rss_bytes, rss_bytes
    t0 = time.perf_counter()
    model, layer = runner_model()
    t_load = time.perf_counter() - t0
    rss_loaded = rss_bytes()
    used, record = [], [False]
    gate_fwd = layer.ffn.gate.forward

    def gate(*a, **k):
        w, i = gate_fwd(*a, **k)
        if record[0]:
            used.append(i.flatten().tolist())
        return w, i
    layer.ffn.gate.forward = gate
    ids = torch.tensor([blm.bench_ids(max(ctx, 256), CFG["vocab_size"])])

    sweep = np.zeros(SWEEP_MIB << 17) if L3 == "cold" else None   # float64

    def decode(tok, pos, n, times=None, cpu=None):
        for s in range(n):
            if sweep is not None and times is not None:
                np.add(sweep, 1.0, out=sweep)  # untimed: evicts the L3
            a, c = time.perf_counter(), time.process_time()
            lg = model(tok, pos + s)
            tok = lg.argmax(-1, keepdim=True).view(1, 1)
            if times is not None:
                times.append(time.perf_counter() - a)
                cpu.append(time.process_time() - c)
        return tok, lg

    lg = model(ids[:, :64], 0)
    decode(lg.argmax(-1).view(1, 1), 64, warm)
    t0 = time.perf_counter()
    if fill == "real":
        lg = model(ids[:, :ctx], 0)
    else:
        lg = synthetic_fill(model, layer, ids, ctx)
    t_fill = time.perf_counter() - t0
    times, cpu = [], []
    record[0] = True
    tok, lg = decode(lg.argmax(-1).view(1, 1), ctx, steps, times, cpu)
    record[0] = False
    flat = [e for step in used for e in step]
    params = dict(model.named_parameters())
    expert = sum(p.numel() * p.element_size() for k, p in params.items()
                 if k.startswith("layers.0.ffn.experts.0."))
    actual = {}
    for k, p in params.items():
        if ".experts." in k:
            continue
        b = getattr(p, "nbytes_read", p.numel() * p.element_size())   # FP8Weight: codes
        if k == "embed.weight":
            b //= p.shape[0]
        actual[_part(k)] = actual.get(_part(k), 0) + b
    actual[_part("layers.0.ffn.experts.0.w1.weight")] = CFG["num_experts_per_tok"] * expert
    actual.update(cache_bytes(ctx))
    print(json.dumps(dict(
        decode_s=sum(times), step_s=times, step_cpu_s=cpu, prefill_s=t_fill if fill == "real" else None,
        fill_s=t_fill, fill=fill, load_s=t_load, rss_loaded_bytes=rss_loaded,
        peak_rss_bytes=peak_rss_bytes(), isa=dc.get_isa(), threads=torch.get_num_threads(),
        experts_distinct=len(set(flat)), experts_picks=len(flat),
        logits_finite=bool(torch.isfinite(lg).all()), actual_bytes=actual, wo_a=WO_A,
        f32_weights=F32W, moe=MOE, indexer=INDEXER, l3=L3)))


def components_worker(threads, reps=7):
    """Where a decode step's time goes: each weight-reading piece of the released
    model.py's step timed alone on this layer's weights, cold (a 512 MiB sweep between
    calls evicts them from the L3), median of `reps`; bytes / seconds = GB/s.  Prints
    JSON {name: {bytes, s, gbs, how}}."""
    import torch
    torch.set_num_threads(threads)
    import deepseek_csa.torch as dct
    from deepseek_csa.generate import load_checkpoint, read_config
    root = model_dir()
    torch.set_default_dtype(torch.bfloat16)
    mod = dct.load_model_py(str(inference_dir()))
    margs, _ = read_config(str(root / "runner.json"), mod.ModelArgs)
    with torch.device("cpu"):
        model = mod.Transformer(margs)
    load_checkpoint(model, str(root / "ckpt" / "model0-mp1.safetensors"), log=lambda *a: None)
    layer, d = model.layers[0], CFG["hidden_size"]
    attn, ffn = layer.attn, layer.ffn
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(1, 1, d, generator=g).bfloat16()
    qr = torch.randn(1, 1, CFG["q_lora_rank"], generator=g).bfloat16()
    og = CFG["o_groups"]
    o = torch.randn(1, 1, og, CFG["num_attention_heads"] * CFG["head_dim"] // og,
                    generator=g).bfloat16()
    wo_a = attn.wo_a.weight.view(og, CFG["o_lora_rank"], -1)
    ob = torch.randn(1, 1, og * CFG["o_lora_rank"], generator=g).bfloat16()
    mid = torch.randn(1, CFG["moe_intermediate_size"], generator=g).bfloat16()
    sweep = np.ones(128 << 20, np.float32)
    nb = lambda *ts: sum(t.numel() * t.element_size() for t in ts)   # noqa: E731
    lin = lambda m: nb(m.weight) + (nb(m.scale) if m.scale is not None else 0)  # noqa: E731
    ex = [0]

    def expert():
        ex[0] = (ex[0] + 37) % CFG["n_routed_experts"]
        return ffn.experts[ex[0]](x.view(1, d), torch.ones(1, 1))
    e0 = ffn.experts[0]
    from deepseek_csa.torch.checkpoint_width import FP8Weight, requantize_fp8
    w8 = FP8Weight(*requantize_fp8(attn.wo_a.weight.detach())).view(og, CFG["o_lora_rank"], -1)
    from deepseek_csa.torch.checkpoint_width import BF16Weight
    wkv16 = BF16Weight(attn.compressor.wkv.weight.detach().bfloat16())
    parts = {
        "wo_a: FP8 weight-only GEMV (deepseek_csa.generate's default, --wo-a fp8)":
            (lambda: torch.einsum("bsgd,grd->bsgr", o, w8), w8.nbytes_read),
        "wo_a: bf16 einsum (model.py; convert.py widened the FP8)":
            (lambda: torch.einsum("bsgd,grd->bsgr", o, wo_a), nb(attn.wo_a.weight)),
        "wq_b: FP8 fp8_gemm": (lambda: attn.wq_b(qr), lin(attn.wq_b)),
        "wo_b: FP8 fp8_gemm": (lambda: attn.wo_b(ob), lin(attn.wo_b)),
        "compressor wkv: float32 F.linear (model.py widens the bf16)":
            (lambda: attn.compressor.wkv(x.float()), lin(attn.compressor.wkv)),
        "compressor wkv: held in bf16, float32 GEMV (--f32-weights bf16)":
            (lambda: torch.nn.functional.linear(x.float(), wkv16), wkv16.nbytes_read),
        "shared expert: FP8 w1 + w3 + w2": (lambda: ffn.shared_experts(x.view(1, d)),
                                            sum(lin(m) for m in (ffn.shared_experts.w1,
                                                ffn.shared_experts.w2, ffn.shared_experts.w3))),
        "one routed expert: FP4 w1 + w3 + w2 (a different one each call)":
            (expert, sum(lin(m) for m in (e0.w1, e0.w2, e0.w3))),
        "router: bf16 weight widened to float32 each call (model.py Gate)":
            (lambda: ffn.gate(x.view(1, d).float()), nb(ffn.gate.weight)),
        "expert w2 alone: FP4 fp4_gemm": (lambda: e0.w2(mid), lin(e0.w2)),
    }
    from deepseek_csa.torch.fused_moe import fuse_moe
    fuse_moe(model)                       # the runner's default (--moe fused)
    ids = torch.zeros(1, 1, dtype=torch.long)
    with torch.inference_mode():
        _, idx = ffn.gate(x.view(1, d).float(), ids.flatten())
    moe_b = (nb(ffn.gate.weight) + sum(lin(m) for m in (ffn.shared_experts.w1, ffn.shared_experts.w2,
                                                      ffn.shared_experts.w3))
             + idx.numel() * sum(lin(m) for m in (e0.w1, e0.w2, e0.w3)))
    parts["MoE, fused (the runner's default): router, 6 routed experts, shared expert"] = (
        lambda: ffn(x, ids), moe_b)
    out = {}
    with torch.inference_mode():
        for name, (fn, b) in parts.items():
            fn()
            ts = []
            for _ in range(reps):
                sweep += 1.0
                a = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - a)
            sec = statistics.median(ts)
            out[name] = dict(bytes=b, s=sec, gbs=b / sec / 1e9)
    # what a read of the same sizes reaches, cold, in our C probe at this ISA level
    import harness
    for b in (33556480, 25167360, 13369344):
        gbs = harness.read_gbs(b, threads, reps)
        out[f"plain read of {b / 1e6:.1f} MB (harness.read_gbs, C, {threads} threads)"] = dict(
            bytes=b, s=b / gbs / 1e9, gbs=gbs)
    print(json.dumps(out))


def run_runner(ctx, steps, fill, threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", fill, "--ctx", str(ctx),
           "--steps", str(steps), "--threads", str(threads), "--wo-a", WO_A,
           "--f32-weights", F32W, "--moe", MOE, "--indexer", INDEXER, "--l3", L3]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    if r.returncode != 0:
        raise RuntimeError(f"runner worker failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])


def run_llama(ctx, steps, threads, ggml):
    # the harness reads LLAMACPP_SWEEP_MIB (benchmarks/llamacpp_model.c)
    old = os.environ.get("LLAMACPP_SWEEP_MIB")
    os.environ["LLAMACPP_SWEEP_MIB"] = str(SWEEP_MIB if L3 == "cold" else 0)
    try:
        out = blm.run_side("llama.cpp", model_dir(), threads, ctx, steps, ggml=ggml)
    finally:
        if old is None:
            del os.environ["LLAMACPP_SWEEP_MIB"]
        else:
            os.environ["LLAMACPP_SWEEP_MIB"] = old
    if L3 == "cold" and not out.get("l3_sweep_mib"):
        raise RuntimeError("the llama.cpp harness ignored LLAMACPP_SWEEP_MIB: rebuild it "
                           "with `make peers` (benchmarks/llamacpp_model.c is newer)")
    return out


# ---------------------------------------------------------------- the run
def summarize(side, raw, ctx, steps, triad):
    must = must_bytes(ctx)
    sec = statistics.median(x["decode_s"] for x in raw) / steps
    r = dict(side=side, ctx=ctx, steps=steps, rounds=len(raw), step_ms=1e3 * sec,
             tokens_per_s=1 / sec, must_bytes=sum(must.values()), must_parts=must,
             peak_rss_bytes=max(x["peak_rss_bytes"] for x in raw), raw=raw)
    cpu = [x.get("decode_cpu_s", sum(x.get("step_cpu_s", [])) or None) for x in raw]
    if all(cpu):
        # process CPU seconds a step (every thread; OMP_WAIT_POLICY=passive: no spinning)
        r["cpu_ms"] = 1e3 * statistics.median(cpu) / steps
    r["must_gbs"] = r["must_bytes"] / sec / 1e9
    r["must_gbs_over_triad"] = r["must_gbs"] / triad
    if "actual_bytes" in raw[0]:
        act = raw[0]["actual_bytes"]
        r["actual_bytes"], r["actual_parts"] = sum(act.values()), act
        r["actual_gbs"] = r["actual_bytes"] / sec / 1e9
        r["actual_gbs_over_triad"] = r["actual_gbs"] / triad
        r["step_ms_median"] = 1e3 * statistics.median(s for x in raw for s in x["step_s"])
        r["step_cpu_ms_median"] = 1e3 * statistics.median(s for x in raw for s in x["step_cpu_s"])
        r["experts_distinct"] = max(x["experts_distinct"] for x in raw)
        r["experts_picks"] = raw[0]["experts_picks"]
    # 43 layers of this step (the 3 hash-routed / 20 HCA layers read a little less:
    # no indexer) and V4-Flash's bf16 head at the bandwidth this step achieved
    layer_bytes = r["must_bytes"] - must["embed row / head (this model's 512-token vocab)"]
    t_layer = sec * layer_bytes / r["must_bytes"]
    t_tok = FLASH_LAYERS * t_layer + flash_head_bytes() / (r["must_gbs"] * 1e9)
    r["flash43_tokens_per_s"] = 1 / t_tok
    r["flash43_bytes_per_token"] = FLASH_LAYERS * layer_bytes + flash_head_bytes()
    return r


def fmt(r):
    s = (f"width   ctx={r['ctx']:<6} {r['side']:<22} {r['step_ms']:7.2f} ms/step "
         + (f"({r['cpu_ms']:.1f} ms CPU) " if r.get("cpu_ms") else "")
         + f"({r['tokens_per_s']:6.1f} tok/s) | must {r['must_bytes'] / 1e6:6.1f} MB -> "
         f"{r['must_gbs']:5.1f} GB/s = {100 * r['must_gbs_over_triad']:5.1f}% triad")
    if "actual_bytes" in r:
        s += (f" | actual {r['actual_bytes'] / 1e6:6.1f} MB -> {r['actual_gbs']:5.1f} GB/s = "
              f"{100 * r['actual_gbs_over_triad']:5.1f}% | step median {r['step_ms_median']:.1f} ms "
              f"wall, {r['step_cpu_ms_median']:.1f} ms CPU | experts {r['experts_distinct']}/256 "
              f"in {r['experts_picks']} picks")
    return s + (f" | V4-Flash 43 layers ~{r['flash43_tokens_per_s']:.2f} tok/s | peak "
                f"{r['peak_rss_bytes'] / 2**30:.2f} GiB")


def plot(snap, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = snap["rows"]
    ctxs = sorted({r["ctx"] for r in rows})
    sides = list(dict.fromkeys(r["side"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    w = 0.8 / len(sides)
    for j, side in enumerate(sides):
        for ax, key in zip(axes, ("step_ms", "must_gbs")):
            xs = [i + j * w for i, c in enumerate(ctxs)
                  if any(r["side"] == side and r["ctx"] == c for r in rows)]
            ys = [r[key] for c in ctxs for r in rows if r["side"] == side and r["ctx"] == c]
            ax.bar(xs, ys, w, label=side)
    tri = snap["triad_gbs"]
    floor = [1e3 * sum(must_bytes(c).values()) / (tri * 1e9) for c in ctxs]
    for i, f in enumerate(floor):
        axes[0].hlines(f, i - 0.1, i + 0.9, colors="k", linestyles="--",
                       label="must-read bytes at the triad" if i == 0 else None)
        axes[0].hlines(f / 0.8, i - 0.1, i + 0.9, colors="r", linestyles=":",
                       label="... at 80% of it (bar)" if i == 0 else None)
    axes[1].axhline(tri, color="k", ls="--", label=f"STREAM triad {tri:.1f} GB/s")
    axes[1].axhline(0.8 * tri, color="r", ls=":", label="80% of it (bar)")
    for ax, yl in zip(axes, ("ms per decode step (lower is better)",
                             "GB/s on the must-read bytes")):
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(ctxs))])
        ax.set_xticklabels([f"after {c // 1024}K tokens" for c in ctxs])
        ax.set_ylabel(yl)
        ax.legend(fontsize=7)
    fig.suptitle(f"One V4-Flash layer at the released width (256 FP4 experts, FP8 attention), "
                 f"{snap['cpu']}, {snap['threads']} threads, ours at {snap['isa']}; load average "
                 f"{snap['load_avg_start'][0]:.1f} at the start (a shared host)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    global WO_A, F32W, MOE, INDEXER, L3
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)))
    ap.add_argument("--prepare", action="store_true", help="only write / convert the model")
    ap.add_argument("--steps", type=int, default=64, help="decode steps a run")
    ap.add_argument("--ctx", default="4096,65536")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--sides", default="runner,runner synthetic,llama.cpp")
    ap.add_argument("--llama-max-ctx", type=int, default=MAX_CTX,
                    help="llama.cpp prefills for real: skip its rows beyond this context")
    ap.add_argument("--ggml", default=None)
    ap.add_argument("--harness", help="llamacpp_model binary (default: make peers' one)")
    ap.add_argument("--wait-policy", default="passive",
                    help="OMP_WAIT_POLICY of both sides (docs/runner.md, Threads: on a shared "
                         "host spinning threads wait for descheduled peers); '' keeps the "
                         "environment's")
    ap.add_argument("--out", default=None)
    ap.add_argument("--note", default="")
    ap.add_argument("--replot", metavar="JSON")
    ap.add_argument("--wo-a", choices=("fp8", "bf16"), default=WO_A,
                    help="our runner's wo_a (deepseek_csa.generate --wo-a): fp8 (default) "
                         "or bf16, model.py's einsum as released")
    ap.add_argument("--f32-weights", choices=("bf16", "f32"), default=F32W,
                    help="our runner's float32 weights with bf16 values (deepseek_csa.generate "
                         "--f32-weights): bf16 (default) or f32, as released")
    ap.add_argument("--moe", choices=("fused", "loop"), default=MOE,
                    help="our runner's MoE (deepseek_csa.generate --moe): fused (default; "
                         "the released loop's bits) or loop, model.py's as released")
    ap.add_argument("--indexer", choices=("fused", "einsum"), default=INDEXER,
                    help="our runner's indexer at decode (deepseek_csa.generate --indexer): "
                         "fused (default; the released selection) or einsum, as released")
    ap.add_argument("--l3", choices=("cold", "warm"), default=L3,
                    help=f"both sides: cold (default; an untimed {SWEEP_MIB} MiB pass before "
                         "each timed step evicts the L3, as a many-layer model finds it) or "
                         "warm (consecutive steps of the one layer)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    WO_A, F32W, MOE, INDEXER, L3 = a.wo_a, a.f32_weights, a.moe, a.indexer, a.l3
    if a.replot:
        plot(json.loads(Path(a.replot).read_text()), Path(a.replot).with_suffix(".png"))
        return 0
    if a.worker == "components":
        components_worker(a.threads)
        return 0
    if a.worker:
        runner_worker(int(a.ctx), a.steps, a.worker, a.threads)
        return 0
    import harness
    if inference_dir() is None:
        print("SKIP bench_released_width: DeepSeek's released inference/model.py and "
              "convert.py not found (tests/released_files.py says where they are looked "
              "for; DEEPSEEK_MODEL_PY points elsewhere)")
        return 0
    try:
        root, how = prepare()
    except FileNotFoundError as e:
        print(f"SKIP bench_released_width: {e}")
        return 0
    if a.prepare:
        print(f"width44: ready under {root}")
        return 0
    ggml = a.ggml or blm.default_ggml()
    if a.harness:
        blm.HARNESS = Path(a.harness)
    if a.wait_policy:
        os.environ["OMP_WAIT_POLICY"] = a.wait_policy     # inherited by both sides
    t_start = time.time()
    load0 = os.getloadavg()
    cpu0 = time.process_time(), os.times()
    triads = [triad_gbs(a.threads)]
    print(f"width44: {root}; GGUF: {how}; STREAM triad {triads[0]:.1f} GB/s, {a.threads} threads",
          flush=True)
    rows = []
    sides = [s.strip() for s in a.sides.split(",")]
    for ctx in (int(c) for c in a.ctx.split(",")):
        raw = {}
        for rd in range(a.rounds):
            for s in (sides if rd % 2 == 0 else sides[::-1]):
                tri_before = triad_gbs(a.threads, 3)
                triads.append(tri_before)
                c0, w0 = os.times(), time.time()
                if s == "llama.cpp":
                    if ctx > a.llama_max_ctx:
                        continue
                    x = run_llama(ctx, a.steps, a.threads, ggml)
                elif s == "runner":
                    if ctx > 8192:        # model.py's one-call prefill: see the docstring
                        continue
                    x = run_runner(ctx, a.steps, "real", a.threads)
                else:
                    x = run_runner(ctx, a.steps, "synthetic", a.threads)
                c1 = os.times()
                # the whole process (load, prefill, decode): CPU seconds beside wall seconds
                raw.setdefault(s, []).append(dict(
                    x, load_avg_1min=os.getloadavg()[0], process_wall_s=time.time() - w0,
                    triad_gbs_before=tri_before,
                    process_cpu_s=(c1.children_user + c1.children_system
                                   - c0.children_user - c0.children_system)))
        for s, xs in raw.items():
            r = summarize(s, xs, ctx, a.steps, statistics.mean(triads))
            r["load_avg_1min"] = max(x["load_avg_1min"] for x in xs)
            rows.append(r)
            print(fmt(r), flush=True)
        ours = [r for r in rows if r["ctx"] == ctx and r["side"].startswith("runner")]
        ll = [r for r in rows if r["ctx"] == ctx and r["side"] == "llama.cpp"]
        if ours and ll:
            best = min(ours, key=lambda r: r["step_ms"])
            print(f"width   ctx={ctx:<6} ours ({best['side']}) / llama.cpp tokens/s "
                  f"x{ll[0]['step_ms'] / best['step_ms']:.2f} wall"
                  + (f", x{ll[0]['cpu_ms'] / best['cpu_ms']:.2f} CPU time"
                     if ll[0].get("cpu_ms") and best.get("cpu_ms") else ""), flush=True)
    triads.append(triad_gbs(a.threads))
    tri = statistics.mean(triads)
    for r in rows:                       # against the mean of the run's triads
        r["must_gbs_over_triad"] = r["must_gbs"] / tri
        r["triad_gbs_just_before"] = statistics.mean(x["triad_gbs_before"] for x in r["raw"])
        if "actual_gbs" in r:
            r["actual_gbs_over_triad"] = r["actual_gbs"] / tri
    print(f"width44: STREAM triad {triads[0]:.1f} before, {triads[-1]:.1f} GB/s after, mean of "
          f"{len(triads)} (one before each side's run) {tri:.1f}", flush=True)
    bars = []
    for ctx in sorted({r["ctx"] for r in rows}):
        ours = [r for r in rows if r["ctx"] == ctx and r["side"].startswith("runner")]
        ll = [r for r in rows if r["ctx"] == ctx and r["side"] == "llama.cpp"]
        if ours:
            best = min(ours, key=lambda r: r["step_ms"])
            bars.append(dict(ctx=ctx, bar="ours >= 80% of the triad on the must-read bytes",
                             met=best["must_gbs_over_triad"] >= 0.8,
                             value=best["must_gbs_over_triad"], side=best["side"]))
            if ll:
                x = ll[0]["step_ms"] / best["step_ms"]
                bars.append(dict(ctx=ctx, bar="ours >= llama.cpp (tokens/s)", met=x >= 1,
                                 value=x, side=best["side"],
                                 cpu_ratio=(ll[0]["cpu_ms"] / best["cpu_ms"]
                                            if ll[0].get("cpu_ms") and best.get("cpu_ms")
                                            else None)))
    for b in bars:
        print(f"bar     ctx={b['ctx']:<6} {b['bar']:<48} {'met' if b['met'] else 'NOT met'}: "
              f"{b['value']:.2f} ({b['side']})")
    t_wall = time.time() - t_start
    ch = os.times()
    cpu_children = (ch.children_user + ch.children_system
                    - cpu0[1].children_user - cpu0[1].children_system)
    snap = dict(
        note="benchmarks/bench_released_width.py: one V4-Flash layer at the released width "
             "(CSA ratio 4, 256 FP4 experts, FP8 attention / indexer / shared expert), random "
             "weights; our runner (released model.py on deepseek_csa's kernel module) vs "
             "llama.cpp. " + a.note,
        config=CFG, seed=SEED, runner_config=runner_config(), runner_wo_a=WO_A,
        runner_f32_weights=F32W, runner_moe=MOE, runner_indexer=INDEXER, l3=L3,
        l3_sweep_mib=SWEEP_MIB if L3 == "cold" else 0, gguf=how, ggml=ggml,
        llamacpp_version=blm.LLAMACPP_VERSION, cpu=harness.cpu_model(), isa=_isa(),
        threads=a.threads, env=harness.environment(a.threads), triad_gbs=tri,
        triad_runs_gbs=triads, load_avg_start=load0, load_avg_end=os.getloadavg(),
        cpu_seconds_children=cpu_children, wall_s=t_wall, rows=rows, bars=bars,
        public=PUBLIC, flash_layers=FLASH_LAYERS, flash_head_bytes=flash_head_bytes())
    out = Path(a.out) if a.out else harness.RESULTS / "released_width.json"
    out.write_text(json.dumps(snap, indent=1, default=float))
    plot(snap, out.with_suffix(".png"))
    print(f"wrote {out} ({t_wall:.0f} s)")
    return 0


def _isa():
    import deepseek_csa as dc
    return dc.get_isa()


if __name__ == "__main__":
    sys.exit(main())
