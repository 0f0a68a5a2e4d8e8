"""llama.cpp beside us at the MODEL level (issue 27 items 3 and 4): one V4-Flash-WIDTH
model with random weights run by llama.cpp, by transformers eager and by transformers +
deepseek_csa.transformers.swap, on the very same weights.

    PEERS_EXTRA_TARGETS="llama-bench llama" make peers   # once: libllama, llama-bench and
                                                          # benchmarks/llamacpp_model.c (~15 min)
    PEERS_GGML_ISA=noamx make peers                       # once, AMX hosts: ggml without AMX (~8 min)
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_llamacpp_model.py          # every row
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_llamacpp_model.py --quick  # decode@4K + cross-engine
    .venv/bin/python benchmarks/bench_llamacpp_model.py --check-only               # cross-engine rows only

Durations (2 cores): the model and its GGUF are written once (~2 min, ~4 GB under
build/peers/model27/); --quick ~8 min; --check-only ~15 min (with the diagnostic GGUFs,
written once, ~2 min more); the full run an estimated 2 h, most of it the decode row
after 32K tokens (one round: llama.cpp alone needs ~13 min to prefill them).  With the
released files: the runner's checkpoint once (~10 s), and in the cross-engine rows the
released model.py's two reference runs (~5 min on a loaded 2-core host, cached with
--reuse-ref; ~14 GB resident for the float64 diagnostic, ~6 GB else) and the runner's.  bench_llamacpp.py can call run(argv) and bench_summary().

The model (MODEL below): hidden 4096, 64 heads x 512 (RoPE 64), q_lora 1024, 8 x 1024
output groups, window 128, 64 index heads x 128, top-512, hyper-connections x4, YaRN on
the compressed layers -- V4-Flash's widths -- but 3 layers: a window-only layer (ratio 0,
hash-routed MoE), a CSA layer (ratio 4, indexer) and an HCA layer (ratio 128); 8 routed
experts of 2048 with V4-Flash's 6 active + 1 shared (so a token's expert compute is
V4-Flash's per layer), a word-level vocabulary of 512 "w<i>" tokens.

It is written once under build/peers/model27/<key>/ (ignored by git; <key> hashes the
config and the seed, so reruns reuse it):
  hf/        the released Hugging Face checkpoint layout (DeepSeek's tensor names;
             FP8 e4m3 weights with ue8m0 128x128 block scales, FP4 e2m1 experts packed
             two a byte with ue8m0 scales per 32, bf16 / float32 elsewhere) plus
             config.json and a word-level tokenizer.json -- what llama.cpp's converter reads;
  hf-bf16/   the same names and config, every FP8 / FP4 weight dequantized (exactly: the
             values are on the bf16 grid) -- what transformers' from_pretrained loads
             (its deepseek_v4 conversion mapping renames the released names);
  model.gguf llama.cpp's own converter (convert_hf_to_gguf.py of the vendored tree, its
             gguf-py) run on hf/; see convert_gguf() for the one step we replace.

Sides: "llama.cpp" = benchmarks/llamacpp_model.c against libllama (a subprocess per run;
its own thread count = ours), "hf eager" = transformers 5.23 DeepseekV4ForCausalLM,
attn_implementation eager, float32, "hf + swap" = the same model after
deepseek_csa.transformers.swap(model), "hf + swap bf16" = the model in bfloat16 (the
FP8 / FP4 values are exact in bf16; half the weight bytes of float32), swapped.  llama.cpp
runs over the ggml built without AMX (--ggml noamx, the default when built): with the
native ggml its defaults abort on an AMX host (docs/peers.md section 7).  "runner" = our
runner, python -m deepseek_csa.generate: DeepSeek's released inference/model.py on
deepseek_csa's kernel module, on the checkpoint the released convert.py makes from hf/
(run once, cached under build/peers/model27/<key>/runner-<sha of convert.py>/, with the
ModelArgs config.json beside it); the released files are found where
tests/released_files.py looks (or --inference-dir DIR); without them its rows say so.

Rows: prefill tokens/s at 512 / 2048 / 8192 prompt tokens; decode tokens/s after 4K and
32K tokens of context; peak resident memory of each run (its own process); the weight
formats each side multiplies.  Cross-engine row: the same prompt, last-position logits
relative error against transformers eager and greedy-token agreement over 32 steps,
free-running and teacher-forced; with the released files also against DeepSeek's
released model.py run in plain PyTorch (bf16, its own torch code on the float32 torch
stand-ins of its GPU kernel module, deepseek_csa.reference.kernel_module: every row's
"vs_model_py"), and, without --quick, that model with its GEMMs summed in float64 (how
far a last-bit difference travels through its FP8 roundings); without --quick also
llama.cpp on diagnostic GGUFs (F32 instead of Q8_0 / BF16, F32 experts instead of MXFP4)
and K/V settings, which locate its deviation (docs/peers.md section 7).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
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

from llamacpp_pin import LLAMACPP_VERSION, PEERS  # noqa: E402  (one pin, one build folder)

LLAMA_TREE = PEERS / f"llama_cpp_python-{LLAMACPP_VERSION}" / "vendor" / "llama.cpp"
HARNESS = PEERS / "llamacpp_model"
MODEL_CACHE = PEERS / "model27"

# V4-Flash widths (deepseek_csa.configs.V4_FLASH, transformers' DeepseekV4Config
# defaults), 3 layers, few experts, small vocabulary.
MODEL = dict(
    vocab_size=512, hidden_size=4096, num_hidden_layers=3, num_attention_heads=64,
    num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024,
    o_groups=8, o_lora_rank=1024, moe_intermediate_size=2048, n_routed_experts=8,
    num_experts_per_tok=6, n_shared_experts=1, scoring_func="sqrtsoftplus",
    norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0,
    sliding_window=128, compress_ratios=[0, 4, 128], compress_rope_theta=160000.0,
    rope_theta=10000.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    num_hash_layers=1, index_n_heads=64, index_head_dim=128, index_topk=512,
    num_nextn_predict_layers=0, rms_norm_eps=1e-6, max_position_embeddings=1048576,
    rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=65536,
                      beta_fast=32, beta_slow=1),
    bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
# How decisive the random model's next-token choice is: the head's std is
# HEAD_GAIN / sqrt(hidden) on a unit-RMS final hidden state, so logits have std ~HEAD_GAIN
# and the top-2 gap is usually several units (random weights otherwise give flat logits).
HEAD_GAIN = 8.0
SEED = 27

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


# ---------------------------------------------------------------- the model
def config_json(cfg=None, quantized=True):
    """config.json in the released layout's keys (transformers folds the legacy ones:
    compress_ratios, num_hash_layers, qk_rope_head_dim, rope_scaling)."""
    c = dict(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
             torch_dtype="bfloat16", **(cfg or MODEL))
    # transformers' own keys for the same schedule (its legacy compress_ratios mapping
    # only knows the ratios 4 and 128; the tests' tiny widths use a smaller HCA ratio)
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    c["layer_types"] = [kinds.get(r, "heavily_compressed_attention") for r in c["compress_ratios"]]
    c["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention":
                           max([r for r in c["compress_ratios"] if r > 4] or [128])}
    if quantized:
        c["quantization_config"] = dict(activation_scheme="dynamic", fmt="e4m3",
                                        quant_method="fp8", scale_fmt="ue8m0",
                                        weight_block_size=[128, 128])
        c["expert_dtype"] = "fp4"
    return c


def model_key(cfg=None, seed=SEED, head_gain=HEAD_GAIN):
    blob = json.dumps([cfg or MODEL, seed, head_gain, "v1"], sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def tensor_plan(cfg):
    """(released name, shape, format, init std) of every tensor; format is one of
    fp8 (e4m3 + ue8m0 128x128 blocks), fp4 (e2m1 + ue8m0 per 32), bf16, f32, i32."""
    d, H, D = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    ql, og, ol = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    inter, E, V = cfg["moe_intermediate_size"], cfg["n_routed_experts"], cfg["vocab_size"]
    hc, Hi, Di = cfg["hc_mult"], cfg["index_n_heads"], cfg["index_head_dim"]
    mix = (2 + hc) * hc
    s = lambda fan_in: fan_in ** -0.5  # noqa: E731
    out = [("embed.weight", (V, d), "bf16", 1.0),
           ("norm.weight", (d,), "f32", "norm"),
           ("head.weight", (V, d), "bf16", HEAD_GAIN * s(d)),
           ("hc_head_fn", (hc, hc * d), "f32", s(hc * d)),
           ("hc_head_base", (hc,), "f32", 0.5),
           ("hc_head_scale", (1,), "f32", "scale")]
    for i, ratio in enumerate(cfg["compress_ratios"]):
        p = f"layers.{i}."
        out += [(p + "attn_norm.weight", (d,), "f32", "norm"),
                (p + "ffn_norm.weight", (d,), "f32", "norm")]
        for part in ("attn", "ffn"):
            out += [(p + f"hc_{part}_fn", (mix, hc * d), "f32", s(hc * d)),
                    (p + f"hc_{part}_base", (mix,), "f32", 0.5),
                    (p + f"hc_{part}_scale", (3,), "f32", "scale")]
        a = p + "attn."
        out += [(a + "attn_sink", (H,), "f32", 0.5),
                (a + "wq_a.weight", (ql, d), "fp8", s(d)),
                (a + "q_norm.weight", (ql,), "f32", "norm"),
                (a + "wq_b.weight", (H * D, ql), "fp8", s(ql)),
                (a + "wkv.weight", (D, d), "fp8", s(d)),
                (a + "kv_norm.weight", (D,), "f32", "norm"),
                (a + "wo_a.weight", (og * ol, H * D // og), "fp8", s(H * D // og)),
                (a + "wo_b.weight", (d, og * ol), "fp8", s(og * ol))]
        if ratio:
            coff = 2 if ratio == 4 else 1          # CSA's compressor overlaps windows
            c = a + "compressor."
            out += [(c + "ape", (ratio, coff * D), "f32", 0.5),
                    (c + "wkv.weight", (coff * D, d), "f32", s(d)),
                    (c + "wgate.weight", (coff * D, d), "f32", s(d)),
                    (c + "norm.weight", (D,), "f32", "norm")]
        if ratio == 4:
            x = a + "indexer."
            out += [(x + "wq_b.weight", (Hi * Di, ql), "fp8", s(ql)),
                    (x + "weights_proj.weight", (Hi, d), "bf16", s(d)),
                    (x + "compressor.ape", (ratio, 2 * Di), "f32", 0.5),
                    (x + "compressor.wkv.weight", (2 * Di, d), "f32", s(d)),
                    (x + "compressor.wgate.weight", (2 * Di, d), "f32", s(d)),
                    (x + "compressor.norm.weight", (Di,), "f32", "norm")]
        f = p + "ffn."
        out += [(f + "gate.weight", (E, d), "bf16", s(d))]
        if i < cfg["num_hash_layers"]:
            out += [(f + "gate.tid2eid", (V, cfg["num_experts_per_tok"]), "i32", None)]
        else:
            out += [(f + "gate.bias", (E,), "f32", 0.1)]
        for e in range(E):
            for w, shape in (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d))):
                out.append((f + f"experts.{e}.{w}.weight", shape, "fp4", s(shape[1])))
        for w, shape in (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d))):
            out.append((f + f"shared_experts.{w}.weight", shape, "fp8", s(shape[1])))
    return out


def _e8m0_pow2(amax, top):
    """Power-of-two scale (ue8m0) that puts amax at or below the format's largest value."""
    e = np.ceil(np.log2(np.maximum(amax, 1e-30) / top))
    return np.clip(e, -127, 127)


def quant_fp8(w):
    """w float32 [N, K] -> (e4m3 codes as torch.float8_e4m3fn, ue8m0 scales [N/128, K/128]
    as torch.float8_e8m0fnu, the dequantized float32 values)."""
    import torch
    N, K = w.shape
    nb, kb = -(-N // 128), -(-K // 128)
    pad = np.zeros((nb * 128, kb * 128), np.float32)
    pad[:N, :K] = w
    blk = np.abs(pad.reshape(nb, 128, kb, 128)).max(axis=(1, 3))
    e = _e8m0_pow2(blk, 448.0)
    sc = np.repeat(np.repeat(2.0 ** e, 128, 0), 128, 1)[:N, :K].astype(np.float32)
    q = torch.from_numpy(w / sc).to(torch.float8_e4m3fn)
    deq = q.float().numpy() * sc
    s = torch.from_numpy((e + 127).astype(np.uint8)).view(torch.float8_e8m0fnu)
    return q, s, deq


def quant_fp4(w):
    """w float32 [N, K] -> (packed e2m1 codes int8 [N, K/2], element 2i in the low nibble;
    ue8m0 scales [N, K/32] as torch.float8_e8m0fnu; the dequantized float32 values)."""
    import torch
    import deepseek_csa as dc
    N, K = w.shape
    b, s = dc.fp4_quant(np.ascontiguousarray(w, np.float32), 32)
    codes = np.stack([b & 15, b >> 4], -1).reshape(N, K)
    deq = E2M1[codes] * np.repeat(np.exp2(s.astype(np.float32) - 127), 32, 1)
    return (torch.from_numpy(b.view(np.int8)), torch.from_numpy(s).view(torch.float8_e8m0fnu),
            deq.astype(np.float32))


def random_weight(rng, shape, std):
    """A float32 tensor of a tensor_plan row: norm weights around 1, scales around 0.5,
    everything else N(0, std^2)."""
    if std == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if std == "scale":
        return (0.5 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return (std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def make_tensors(cfg=None, seed=SEED):
    """Yields (name, released tensors {name: tensor}, dequantized {name: tensor}, format)
    one released tensor at a time (a V4-Flash-width layer is ~1 GB of float32)."""
    import torch
    cfg = cfg or MODEL
    rng = np.random.default_rng(seed)
    for name, shape, fmt, std in tensor_plan(cfg):
        if fmt == "i32":
            E, k = cfg["n_routed_experts"], shape[1]
            t = np.stack([rng.permutation(E)[:k] for _ in range(shape[0])]).astype(np.int32)
            tt = torch.from_numpy(t)
            yield name, {name: tt}, {name: tt}, fmt
            continue
        w = random_weight(rng, shape, std)
        if fmt == "fp8":
            q, s, deq = quant_fp8(w)
            sname = name[:-len("weight")] + "scale"
            yield name, {name: q, sname: s}, {name: torch.from_numpy(deq).bfloat16()}, fmt
        elif fmt == "fp4":
            q, s, deq = quant_fp4(w)
            sname = name[:-len("weight")] + "scale"
            yield name, {name: q, sname: s}, {name: torch.from_numpy(deq).bfloat16()}, fmt
        elif fmt == "bf16":
            t = torch.from_numpy(w).bfloat16()
            yield name, {name: t}, {name: t}, fmt
        else:
            t = torch.from_numpy(w)
            yield name, {name: t}, {name: t}, fmt


def write_tokenizer(d, vocab_size):
    """A word-level tokenizer.json: token 0 "<bos>", 1 "<eos>", then "w2" ... "w<V-1>"
    (whitespace pre-tokenizer), as the runner's tests build theirs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    words = ["<bos>", "<eos>"] + [f"w{i}" for i in range(2, vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
         "eos_token": "<eos>", "unk_token": "w2", "add_bos_token": False}))


def write_model(root, cfg=None, seed=SEED, log=print):
    """Writes root/hf (released layout) and root/hf-bf16 (dequantized) unless present."""
    from safetensors.torch import save_file
    cfg = cfg or MODEL
    hf, hb = root / "hf", root / "hf-bf16"
    if (hf / "model.safetensors").exists() and (hb / "model.safetensors").exists():
        return hf, hb
    t0 = time.time()
    for d in (hf, hb):
        d.mkdir(parents=True, exist_ok=True)
        write_tokenizer(d, cfg["vocab_size"])
    (hf / "config.json").write_text(json.dumps(config_json(cfg, True), indent=1))
    (hb / "config.json").write_text(json.dumps(config_json(cfg, False), indent=1))
    rel, deq, formats = {}, {}, {}
    for name, r, q, fmt in make_tensors(cfg, seed):
        rel.update(r)
        deq.update(q)
        formats[name] = fmt
    save_file(rel, str(hf / "model.safetensors.tmp"), metadata={"format": "pt"})
    save_file(deq, str(hb / "model.safetensors.tmp"), metadata={"format": "pt"})
    (hf / "model.safetensors.tmp").rename(hf / "model.safetensors")
    (hb / "model.safetensors.tmp").rename(hb / "model.safetensors")
    (root / "formats.json").write_text(json.dumps(formats, indent=0))
    log(f"model27: wrote {hf} and {hb} ({time.time() - t0:.0f} s)")
    return hf, hb


# ---------------------------------------------------------------- GGUF by llama.cpp's converter
# llama.cpp's converter refuses a word-level tokenizer (DeepseekV4Model.set_vocab is the
# GPT-2 BPE path, which hashes the pre-tokenizer and raises "BPE pre-tokenizer was not
# recognized").  The fallback runs the same converter with that one method replaced by
# the tree's own word-level path (TextModel._set_vocab_whitespace: tokenizer model
# "whitespace", its pre-tokenizer hash check answered with "whitespace") plus a
# placeholder merge list (llama.cpp's BPE loader requires the key;
# nothing here tokenizes text: every engine is given token ids).  Tensors, dtypes and
# metadata are the converter's own.
_CONVERT_WORDLEVEL = r"""
import sys
tree, src, out = sys.argv[1:4]
sys.argv_extra = sys.argv[4:]
sys.path.insert(0, tree)
sys.path.insert(1, tree + "/gguf-py")
sys.argv = [tree + "/convert_hf_to_gguf.py", src, "--outfile", out]
import convert_hf_to_gguf as conv
from conversion.base import TextModel
from conversion.deepseek import DeepseekV4Model

def set_vocab(self):
    TextModel._set_vocab_whitespace(self)
    self.gguf_writer.add_token_merges(["w 2"])

DeepseekV4Model.set_vocab = set_vocab
DeepseekV4Model.get_vocab_base_pre = lambda self, tokenizer: "whitespace"
if len(sys.argv_extra) and sys.argv_extra[0] in ("f32", "f32all"):
    # diagnostic variant: every tensor the converter would make Q8_0 / BF16 kept as F32
    import gguf
    DeepseekV4Model.tensor_force_quant = lambda self, *a: gguf.GGMLQuantizationType.F32
if len(sys.argv_extra) and sys.argv_extra[0] == "f32all":
    # ... and the FP4 experts dequantized to F32 instead of re-packed as MXFP4 (whose
    # mul_mat quantizes the activations to Q8_0)
    import numpy as np
    import torch
    from conversion.base import LazyTorchTensor
    E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])

    def write_f32_experts(self, bid, proj, tensor_key):
        mats, consumed = [], []
        for eid in range(self.hparams["n_routed_experts"]):
            wn = f"layers.{bid}.ffn.experts.{eid}.{proj}.weight"
            sn = f"layers.{bid}.ffn.experts.{eid}.{proj}.scale"
            w = LazyTorchTensor.to_eager(self.model_tensors[wn]()).view(torch.uint8)
            sc = LazyTorchTensor.to_eager(self.model_tensors[sn]()).view(torch.uint8)
            codes = torch.stack([w & 15, w >> 4], -1).reshape(w.shape[0], -1).long()
            mats.append(E2M1[codes] * torch.exp2(sc.float() - 127).repeat_interleave(32, 1))
            consumed += [wn, sn]
        data = torch.stack(mats).numpy().astype(np.float32)
        self.gguf_writer.add_tensor(self.format_tensor_name(tensor_key, bid), data)
        return consumed

    DeepseekV4Model._write_mxfp4_expert_tensor = write_f32_experts
conv.main()
"""


def convert_gguf(hf_dir, out, py=sys.executable, log=print, variant="default"):
    """hf_dir (released layout) -> out (GGUF) with the vendored tree's converter and its
    gguf-py.  Returns how the tokenizer was written ("converter" or "converter, word-level
    vocab step replaced").  variant="f32": a diagnostic GGUF whose FP8 (else Q8_0) and
    bf16 (else BF16) tensors are written F32 -- the dequantized values exactly -- so the
    cross-engine row can separate the weight re-quantization from the rest."""
    note = out.with_suffix(".how")
    if out.exists() and note.exists():
        return note.read_text()
    if not (LLAMA_TREE / "convert_hf_to_gguf.py").exists():
        raise FileNotFoundError(f"{LLAMA_TREE} not found: run `make peers` first")
    env = dict(os.environ, PYTHONPATH=str(LLAMA_TREE / "gguf-py"))
    tmp = out.with_suffix(".tmp.gguf")
    t0 = time.time()
    how = "llama.cpp convert_hf_to_gguf.py as is"
    refused = variant != "default"
    if not refused:
        r = subprocess.run([py, str(LLAMA_TREE / "convert_hf_to_gguf.py"), str(hf_dir),
                            "--outfile", str(tmp)], env=env, capture_output=True, text=True)
        if r.returncode != 0 and "pre-tokenizer was not recognized" not in r.stderr + r.stdout:
            raise RuntimeError("convert_hf_to_gguf.py failed:\n" + r.stderr[-3000:])
        refused = r.returncode != 0
        if refused:
            log("model27: the converter refused the word-level tokenizer (BPE pre-tokenizer "
                "not recognized); rerunning it with its vocab step replaced by the tree's "
                "word-level (whitespace) path")
    if refused:
        r = subprocess.run([py, "-c", _CONVERT_WORDLEVEL, str(LLAMA_TREE), str(hf_dir), str(tmp)]
                           + ([variant] if variant != "default" else []),
                           env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError("convert (word-level vocab) failed:\n" + r.stderr[-3000:])
        how = ("llama.cpp convert_hf_to_gguf.py with DeepseekV4Model.set_vocab replaced by "
               "TextModel._set_vocab_whitespace, pre-tokenizer 'whitespace' (the as-is "
               "converter refuses a word-level tokenizer: 'BPE pre-tokenizer was not "
               "recognized')" + {"f32": "; diagnostic variant: Q8_0/BF16 tensors written F32",
                                 "f32all": "; diagnostic variant: Q8_0/BF16 tensors and the FP4 "
                                           "experts written F32"}.get(variant, ""))
    tmp.rename(out)
    note.write_text(how)
    log(f"model27: {out} ({out.stat().st_size / 2**20:.0f} MiB, {time.time() - t0:.0f} s): {how}")
    return how


def gguf_tensor_types(path):
    """{gguf tensor name: ggml type name} read with the tree's gguf-py."""
    sys.path.insert(0, str(LLAMA_TREE / "gguf-py"))
    try:
        import gguf
        rd = gguf.GGUFReader(str(path))
        return {t.name: t.tensor_type.name for t in rd.tensors}
    finally:
        sys.path.remove(str(LLAMA_TREE / "gguf-py"))


# ---------------------------------------------------------------- the three sides
def harness_path():
    return HARNESS


def llama_logits(gguf_path, prompt, steps, threads, forced=None, workdir=None, env=None):
    """llama.cpp's logits ((steps + 1) x vocab float32) after the prompt and after each
    step; the token fed is forced[i] when given, else llama.cpp's own argmax."""
    import tempfile
    with tempfile.TemporaryDirectory(dir=workdir) as td:
        td = Path(td)
        (td / "p.txt").write_text(" ".join(map(str, prompt)))
        cmd = [str(harness_path()), "logits", str(gguf_path), str(threads), str(td / "p.txt"),
               str(steps), str(td / "out.bin")]
        if forced is not None:
            (td / "f.txt").write_text(" ".join(map(str, forced)))
            cmd.append(str(td / "f.txt"))
        r = subprocess.run(cmd, capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS=str(threads), **(env or {})))
        if r.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed ({r.returncode}):\n{r.stderr[-2000:]}")
        lg = np.fromfile(td / "out.bin", np.float32)
        info = json.loads(r.stdout.strip().splitlines()[-1])
    return lg.reshape(steps + 1, -1), info


def load_hf(hf_dir, threads, swapped=False, bf16=False, quantized=False):
    """transformers' DeepseekV4ForCausalLM (eager attention, float32 or bfloat16) from
    hf_dir, swapped onto our kernels when asked, and with quantized=True its projections
    back on the checkpoint's FP8 / FP4 codes (deepseek_csa.transformers.quantize)."""
    import torch
    from transformers import DeepseekV4ForCausalLM
    torch.set_num_threads(threads)
    m = DeepseekV4ForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.bfloat16 if bf16 else torch.float32,
        attn_implementation="eager").eval()
    if swapped:
        from deepseek_csa.transformers import swap
        swap(m)
    if quantized:
        from deepseek_csa.transformers import quantize
        quantize(m)
    return m


def hf_logits(model, prompt, steps, forced=None, chunk=2048):
    """The same protocol as llama_logits on a transformers model: prompt (chunked
    prefill, `chunk` tokens a call, into a DynamicCache), then steps one token each."""
    import torch
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for i in range(0, len(prompt), chunk):
            lg = model(ids[:, i:i + chunk], past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits[0, -1]
        out.append(lg.float().numpy().copy())
        for s in range(steps):
            t = int(forced[s]) if forced is not None else int(lg.argmax())
            lg = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0, -1]
            out.append(lg.float().numpy().copy())
    return np.stack(out)


def greedy_tokens(logits):
    return [int(x) for x in logits.argmax(-1)]


def rel_err(a, ref):
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def compare(name, lg_free, lg_forced, ref_free, steps, ref_forced=None):
    """One cross-engine line: last-prompt-position logits error, free-running greedy
    agreement over `steps` tokens, and teacher-forced (fed the transformers-eager
    reference's tokens) argmax agreement and logits error per step; ref_forced: the
    reference's own logits when it was fed those tokens (default: ref_free, which are
    when the reference is transformers eager itself)."""
    ref_forced = ref_free if ref_forced is None else ref_forced
    toks, ref = greedy_tokens(lg_free)[:steps], greedy_tokens(ref_free)[:steps]
    same = sum(a == b for a, b in zip(toks, ref))
    prefix = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), steps)
    forced_agree = sum(int(a == b) for a, b in zip(lg_forced.argmax(-1)[:steps],
                                                   ref_forced.argmax(-1)[:steps]))
    errs = [rel_err(lg_forced[i], ref_forced[i])
            for i in range(min(len(lg_forced), len(ref_forced)))]
    top2 = np.sort(ref_forced, -1)[:, -2:]
    # where the forced argmax differs: the reference's margin between its own choice and
    # this side's (small margins = a near-tie flipped by the side's perturbation)
    n = min(steps, len(lg_forced), len(ref_forced))
    flips = [dict(step=i, margin=float(ref_forced[i].max() - ref_forced[i][lg_forced[i].argmax()]),
                  logit_err_max=float(np.abs(lg_forced[i] - ref_forced[i]).max()))
             for i in range(n) if lg_forced[i].argmax() != ref_forced[i].argmax()]
    return dict(forced_flips=flips, side=name, last_logits_rel_err=rel_err(lg_free[0], ref_free[0]),
                greedy_same=same, greedy_common_prefix=prefix, steps=steps,
                forced_argmax_agree=forced_agree, forced_rel_err_median=float(np.median(errs)),
                forced_rel_err_max=float(np.max(errs)), tokens=toks,
                ref_top2_gap_min=float((top2[:, 1] - top2[:, 0]).min()))


# ---------------------------------------------------------------- timing workers
def _status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _hwm():
    return _status_bytes("VmHWM")


def _rss():
    return _status_bytes("VmRSS")


def bench_ids(n, vocab):
    """The same deterministic pseudo-random prompt ids as llamacpp_model.c's bench mode."""
    s, out = 12345, []
    for _ in range(max(n, 64)):
        s = (s * 1103515245 + 12345) & 0xFFFFFFFF
        out.append(2 + (s >> 8) % (vocab - 2))
    return out[:n] if n else out


HF_SIDES = ("hf eager", "hf + swap", "hf + swap bf16", "hf + swap fp8", "hf + swap compile")


def hf_worker(side, hf_dir, threads, n_prompt, n_decode, chunk):
    """One timed run in this (fresh) process: load, warm up (64 + 2 tokens), prefill
    n_prompt tokens in `chunk`-token calls, then n_decode greedy steps.  Prints JSON."""
    import torch
    from transformers import DynamicCache
    if side not in HF_SIDES:
        raise ValueError(f"unknown side {side!r}")
    m = load_hf(hf_dir, threads, swapped=side != "hf eager",
                bf16=side.endswith(("bf16", "fp8", "compile")),
                quantized=side.endswith(("fp8", "compile")))
    vocab = m.config.vocab_size
    if side == "hf + swap compile":
        compile_for_run(m, bench_ids(n_prompt, vocab), n_decode, chunk)
    rss_loaded = _rss()
    ids = torch.tensor([bench_ids(n_prompt, vocab)])
    with torch.no_grad():
        cache = DynamicCache(config=m.config)
        lg = m(ids[:, :64], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        for _ in range(2):
            lg = m(lg[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits
        del cache
        cache = DynamicCache(config=m.config)
        t0 = time.perf_counter()
        for i in range(0, n_prompt, chunk):
            lg = m(ids[:, i:i + chunk], past_key_values=cache, use_cache=True,
                   logits_to_keep=1).logits
        t1 = time.perf_counter()
        for _ in range(n_decode):
            lg = m(lg[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits
        t2 = time.perf_counter()
    print(json.dumps(dict(prefill_s=t1 - t0, decode_s=t2 - t1, peak_rss_bytes=_hwm(),
                          rss_loaded_bytes=rss_loaded, rss_end_bytes=_rss())))


def compile_for_run(m, prompt, n_decode, chunk):
    """"hf + swap compile": the "hf + swap fp8" model with its forward compiled as
    docs/transformers.md recommends for decoding (torch.compile with its default
    automatic dynamic shapes, Inductor's C++ wrapper, parameters as graph constants;
    backend from DEEPSEEK_CSA_COMPILE_BACKEND, default inductor), then the timed
    protocol run once untimed on its own cache: every graph
    the timed run needs (each prefill chunk, each phase of the compressors' buffers at
    this context) is compiled before the clock starts, and the timed run, on the same
    shapes, compiles nothing."""
    import torch
    from transformers import DynamicCache
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    torch._inductor.config.cpp_wrapper = True
    m.forward = torch.compile(m.forward,
                              backend=os.environ.get("DEEPSEEK_CSA_COMPILE_BACKEND", "inductor"))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        cache = DynamicCache(config=m.config)
        for i in range(0, ids.shape[1], chunk):
            lg = m(ids[:, i:i + chunk], past_key_values=cache, use_cache=True,
                   logits_to_keep=1).logits
        for _ in range(n_decode):
            lg = m(lg[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits


def run_side(side, root, threads, n_prompt, n_decode, ggml="noamx", chunk=2048,
             runner=None):
    """One fresh process of a side; returns {prefill_s, decode_s, peak_rss_bytes,
    process_cpu_s: the process's whole CPU time, load and warm-up included}."""
    import resource
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = _run_side(side, root, threads, n_prompt, n_decode, ggml, chunk, runner)
    ru2 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out["process_cpu_s"] = ru2.ru_utime + ru2.ru_stime - ru.ru_utime - ru.ru_stime
    return out


def _run_side(side, root, threads, n_prompt, n_decode, ggml, chunk, runner):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if side == "llama.cpp":
        env.update(llama_env(ggml))
        cmd = [str(harness_path()), "bench", str(root / "model.gguf"), str(threads),
               str(n_prompt), str(n_decode), "1"]
    elif side == "runner":
        return run_runner(runner, threads, n_prompt, n_decode, env)
    else:
        # eager's dense scores at 32K context ([64 heads, chunk, window + chunk + 8192
        # compressed] float32, and the indexer's as large) need 1024-token chunks in 23 GB
        chunk = hf_chunk(n_prompt, chunk)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side,
               "--threads", str(threads), "--n-prompt", str(n_prompt),
               "--n-decode", str(n_decode), "--chunk", str(chunk)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{side} run failed ({r.returncode}):\n{r.stderr[-2000:]}")
    out = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            out.update(json.loads(line))
    return out


def hf_chunk(n_prompt, chunk):
    return chunk if n_prompt <= 8192 else min(chunk, 1024)


# ---------------------------------------------------------------- our runner
# the released ModelArgs' max_seq_len sizes the caches (and the RoPE tables): the 32K
# decode row's context and steps fit
RUNNER_MAX_SEQ = 33792
RUNNER_PLAIN_MAX = 8192


def runner_config(cfg=None, max_seq_len=RUNNER_MAX_SEQ):
    """MODEL in the keys of the released inference/config.json (its ModelArgs): FP8
    weights with ue8m0 (e8m0) scales, FP4 experts, batch 1, no MTP layer."""
    c = cfg or MODEL
    yarn = c["rope_scaling"]
    return dict(max_batch_size=1, max_seq_len=max_seq_len, dtype="fp8", scale_fmt="ue8m0",
                expert_dtype="fp4", scale_dtype="fp8", vocab_size=c["vocab_size"],
                dim=c["hidden_size"], moe_inter_dim=c["moe_intermediate_size"],
                n_layers=c["num_hidden_layers"], n_hash_layers=c["num_hash_layers"],
                n_mtp_layers=c["num_nextn_predict_layers"], n_heads=c["num_attention_heads"],
                n_routed_experts=c["n_routed_experts"], n_shared_experts=c["n_shared_experts"],
                n_activated_experts=c["num_experts_per_tok"], score_func=c["scoring_func"],
                route_scale=c["routed_scaling_factor"], swiglu_limit=c["swiglu_limit"],
                q_lora_rank=c["q_lora_rank"], head_dim=c["head_dim"],
                rope_head_dim=c["qk_rope_head_dim"], norm_eps=c["rms_norm_eps"],
                o_groups=c["o_groups"], o_lora_rank=c["o_lora_rank"],
                window_size=c["sliding_window"], compress_ratios=list(c["compress_ratios"]),
                compress_rope_theta=c["compress_rope_theta"],
                original_seq_len=yarn["original_max_position_embeddings"],
                rope_theta=c["rope_theta"], rope_factor=yarn["factor"],
                beta_fast=yarn["beta_fast"], beta_slow=yarn["beta_slow"],
                index_n_heads=c["index_n_heads"], index_head_dim=c["index_head_dim"],
                index_topk=c["index_topk"], hc_mult=c["hc_mult"],
                hc_sinkhorn_iters=c["hc_sinkhorn_iters"], hc_eps=c["hc_eps"])


def find_inference_dir():
    """(DeepSeek's released inference/ folder or None, where it was looked for):
    tests/released_files.py's place (or DEEPSEEK_MODEL_PY)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import released_files
    finally:
        sys.path.remove(str(ROOT / "tests"))
    path, where = released_files.find_v4("model.py")
    return (str(Path(path).parent) if path else None), where


def prepare_runner(root, inference_dir, py=sys.executable, log=print):
    """{inference_dir, ckpt, config} for the runner: root/hf converted by the released
    convert.py of inference_dir (--n-experts E --model-parallel 1 --expert-dtype fp4: the
    FP4 experts kept, wo_a widened to bf16 as the released layout has it), written once
    under root/runner-<sha of convert.py>/ with the ModelArgs config beside it."""
    conv = Path(inference_dir) / "convert.py"
    if not conv.exists():
        raise FileNotFoundError(f"{conv} not found (the runner's checkpoint is made by it)")
    sha = hashlib.sha256(conv.read_bytes()).hexdigest()[:12]
    out = root / f"runner-{sha}"
    cfg = out / "config.json"
    ckpt = out / "mp1"
    if not (ckpt / "model0-mp1.safetensors").exists():
        tmp = out / "mp1.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        r = subprocess.run([py, str(conv), "--hf-ckpt-path", str(root / "hf"), "--save-path",
                            str(tmp), "--n-experts", str(MODEL["n_routed_experts"]),
                            "--model-parallel", "1", "--expert-dtype", "fp4"],
                           capture_output=True, text=True, cwd=str(inference_dir))
        if r.returncode != 0:
            raise RuntimeError(f"{conv} failed ({r.returncode}):\n{r.stderr[-3000:]}")
        tmp.rename(ckpt)
        log(f"model27: {ckpt} written by {conv} ({time.time() - t0:.0f} s)")
    if not cfg.exists():
        cfg.write_text(json.dumps(runner_config(), indent=1))
    return dict(inference_dir=str(inference_dir), ckpt=str(ckpt), config=str(cfg),
                convert_sha=sha)


def run_runner(runner, threads, n_prompt, n_decode, env):
    """Our runner (python -m deepseek_csa.generate) on the released model.py and the
    checkpoint its convert.py made: a token-id prompt of n_prompt, a warm-up as
    llama.cpp's harness has (64 tokens + 2 steps), then one prefill call and n_decode
    decode steps (--max-new-tokens n_decode + 1: the prefill gives the first token);
    the timings and peak RSS of its --output-json."""
    import tempfile
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        ids = bench_ids(n_prompt, MODEL["vocab_size"])
        (td / "p.txt").write_text(" ".join(map(str, ids)) + "\n")
        cmd = [sys.executable, "-m", "deepseek_csa.generate", "--inference-dir",
               runner["inference_dir"], "--ckpt-path", runner["ckpt"], "--config",
               runner["config"], "--input-file", str(td / "p.txt"), "--max-new-tokens",
               str(n_decode + 1), "--warmup", "64", "--eos-id", "-1",
               "--output-json", str(td / "o.json")]
        if n_prompt > RUNNER_PLAIN_MAX:
            # the released Indexer scores [S, 64 heads, S / 4] in one einsum at prefill
            # (34 GB in bf16 at 32K tokens): beyond 8K the runner routes the indexer
            # through deepseek_csa's (fused scoring + top-k, no [S, T] scores)
            cmd += ["--swap", "indexer"]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
        if r.returncode != 0:
            raise RuntimeError(f"runner failed ({r.returncode}):\n{r.stderr[-2000:]}")
        o = json.loads((td / "o.json").read_text())
    return dict(prefill_s=o["prefill_s"], decode_s=o["decode_s"],
                decode_steps=o["decode_steps"], prefill_cpu_s=o.get("prefill_cpu_s"),
                decode_cpu_s=o.get("decode_cpu_s"),
                peak_rss_bytes=max(x["peak_rss"] for x in o["ranks"]))


def default_ggml():
    """noamx when built; else native on a CPU without AMX (llama.cpp's defaults run
    there), native-noextra on an AMX CPU (its defaults abort, docs/peers.md s. 7)."""
    if (PEERS / "llama-build-noamx" / "bin" / "libggml-cpu.so").exists():
        return "noamx"
    try:
        amx = "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        amx = False
    return "native-noextra" if amx else "native"


def llama_env(ggml):
    """Environment for the harness: ggml="noamx" loads libllama over the AVX-512 ggml
    built without AMX (PEERS_GGML_ISA=noamx), "avx2" over the one limited to AVX2
    (PEERS_GGML_ISA=avx2: with DEEPSEEK_CSA_ISA=avx2, what an AVX2-only CPU gets on both
    sides); "native" is the -march=native ggml with
    llama.cpp's defaults (crashes on an AMX host, docs/peers.md section 7);
    "native-noextra" keeps every weight in plain CPU buffers (no CPU_REPACK, no AMX)."""
    if ggml in ("noamx", "avx2"):
        return {"LD_LIBRARY_PATH": str(PEERS / f"llama-build-{ggml}" / "bin")}
    if ggml == "native-noextra":
        return {"LLAMACPP_EXTRA_BUFTS": "0"}
    return {}


# ---------------------------------------------------------------- cross-engine row
LLAMA_VARIANTS = {
    # key: (label, gguf file, extra env) -- "default" is the row, the rest diagnose it
    "default": ("llama.cpp", "model.gguf", {}),
    "f32w": ("llama.cpp F32 weights", "model-f32.gguf", {}),
    "f32w-kv32": ("llama.cpp F32 weights, F32 K/V", "model-f32.gguf", {"LLAMACPP_KV": "f32"}),
    "f32w-kv32-nofa": ("llama.cpp F32 weights, F32 K/V, no flash-attn", "model-f32.gguf",
                       {"LLAMACPP_KV": "f32", "LLAMACPP_FA": "0"}),
    "f32all": ("llama.cpp F32 weights + F32 experts (F16 K/V)", "model-f32all.gguf", {}),
    "f32all-kv32-nofa": ("llama.cpp F32 weights + F32 experts, F32 K/V, no flash-attn",
                         "model-f32all.gguf", {"LLAMACPP_KV": "f32", "LLAMACPP_FA": "0"}),
}


def _gemms_in_float64(mod):
    """The reference's FP8 / FP4 GEMMs accumulated in float64 (then rounded as before):
    a perturbation below float32 rounding, to size how far the released arithmetic's
    FP8 roundings carry a last-bit difference."""
    import torch
    from deepseek_csa.reference import kernel_module as KM
    G = vars(mod)
    w8, w4 = {}, {}

    def gemm(weights, fn):
        def f(a, a_s, b, b_s, scale_dtype=None):
            key = (b.data_ptr(), tuple(b.shape))
            if key not in weights:
                weights[key] = fn(b, b_s).double()
            return (KM._deq_a(a, a_s).double() @ weights[key].T).float().to(
                torch.get_default_dtype())
        return f
    G["fp8_gemm"], G["fp4_gemm"] = gemm(w8, KM.fp8_weight_f32), gemm(w4, KM.fp4_weight_f32)


def model_py_logits(runner, prompt, steps, threads, forced=None, reference=False,
                    gemm64=False):
    """DeepSeek's released model.py (runner["inference_dir"]) on the runner's
    checkpoint (its convert.py's output), bf16 as the released generate.py runs it:
    logits after the prompt (one prefill call) and after each of `steps` decode steps,
    fed forced[i] or its own argmax.  reference=True: the file's own torch code on the
    float32 torch stand-ins of its kernel module (deepseek_csa.reference.kernel_module:
    the released model in plain PyTorch); else on deepseek_csa's kernel module with the
    runner's set-up (what python -m deepseek_csa.generate runs)."""
    import contextlib
    import torch
    import deepseek_csa.torch as dct
    from deepseek_csa import generate as G
    from deepseek_csa.reference import kernel_module as KM
    from deepseek_csa.torch.kernel_module import preserved_modules
    torch.set_num_threads(threads)
    prev = torch.get_default_dtype()
    out = []
    with preserved_modules(("kernel", "fast_hadamard_transform")):
        mod = dct.load_model_py(runner["inference_dir"])
        if not reference:
            G._rows_hc_post(mod)
        torch.set_default_dtype(torch.bfloat16)
        try:
            args, _ = G.read_config(runner["config"], mod.ModelArgs)
            model = mod.Transformer(args)
            G.load_checkpoint(model, G.shard_path(runner["ckpt"], 0, 1), log=lambda *a: None)
            with (KM.installed_in(mod, cache_weights=True) if reference
                  else contextlib.nullcontext()):
                if gemm64:
                    _gemms_in_float64(mod)
                lg = model(torch.tensor([prompt]), 0)[0]
                out.append(lg.float().numpy().copy())
                for i in range(steps):
                    t = int(forced[i]) if forced is not None else int(lg.argmax())
                    lg = model(torch.tensor([[t]]), len(prompt) + i)[0]
                    out.append(lg.float().numpy().copy())
        finally:
            torch.set_default_dtype(prev)
    return np.stack(out)


def vs_model_py(row, free, forced, mp):
    """row["vs_model_py"]: this side against the released model.py (mp = its free
    logits and its logits fed the eager reference's tokens, as every side's forced run
    is): last-position logits error, free-running greedy agreement, forced argmax."""
    if mp is None:
        return row
    c = compare(row["side"], free, forced, mp[0], row["steps"], ref_forced=mp[1])
    row["vs_model_py"] = {k: c[k] for k in (
        "last_logits_rel_err", "greedy_same", "greedy_common_prefix", "forced_argmax_agree",
        "forced_rel_err_median", "forced_rel_err_max", "forced_flips", "ref_top2_gap_min")}
    return row


def cross_engine(root, threads, prompt_len, steps, ggml, variants, log=print,
                 reuse_ref=False, with_swap=True, runner=None):
    """The cross-engine rows: transformers eager is the reference (DeepSeek's released
    model.py is absent here); each other side is run free (its own greedy tokens) and
    teacher-forced with the reference's tokens.  reuse_ref: take eager's logits from the
    previous run's cache file (root/ref-<prompt>-<steps>.npy) when present.  With
    `runner` (the released inference/ folder and the checkpoint its convert.py made):
    the released model.py in plain PyTorch is the second reference (every row's
    "vs_model_py"), and our runner is a side."""
    import random
    import transformers
    rng = random.Random(SEED)
    prompt = [rng.randrange(2, MODEL["vocab_size"]) for _ in range(prompt_len)]
    cache = root / f"ref-{prompt_len}-{steps}-{transformers.__version__}.npy"
    t0 = time.time()
    m = None
    if reuse_ref and cache.exists():
        ref = np.load(cache)
    else:
        m = load_hf(root / "hf-bf16", threads)
        ref = hf_logits(m, prompt, steps)
        np.save(cache, ref)
    toks = greedy_tokens(ref)[:steps]
    mp = None
    out = []
    if runner is not None:
        t1 = time.time()
        mcache = root / f"modelpy-ref-{prompt_len}-{steps}-{runner.get('convert_sha', 'x')}.npz"
        if reuse_ref and mcache.exists():
            z = np.load(mcache)
            mp = (z["free"], z["forced"])
        else:
            mp = (model_py_logits(runner, prompt, steps, threads, reference=True),
                  model_py_logits(runner, prompt, steps, threads, forced=toks, reference=True))
            np.savez(mcache, free=mp[0], forced=mp[1])
        row = compare("released model.py (plain PyTorch, bf16)", mp[0], mp[1], ref, steps)
        out.append(vs_model_py(dict(row, seconds=time.time() - t1), *mp, mp))
        log(fmt_cross(out[-1]))
        if "default" not in variants or len(variants) > 1:
            # diagnostic: the same file with its GEMMs summed in float64 -- how far a
            # last-bit difference travels through the released FP8 / FP4 roundings
            t1 = time.time()
            g = model_py_logits(runner, prompt, steps, threads, reference=True, gemm64=True)
            gf = model_py_logits(runner, prompt, steps, threads, forced=toks, reference=True,
                                 gemm64=True)
            out.append(vs_model_py(dict(compare("released model.py, GEMMs summed in float64",
                                                g, gf, ref, steps),
                                        seconds=time.time() - t1), g, gf, mp))
            log(fmt_cross(out[-1]))
    out.insert(0, vs_model_py(dict(compare("hf eager (reference)", ref, ref, ref, steps),
                                   seconds=time.time() - t0), ref, ref, mp))
    log(fmt_cross(out[0]))
    if runner is not None:
        t0 = time.time()
        rf = model_py_logits(runner, prompt, steps, threads)
        rff = model_py_logits(runner, prompt, steps, threads, forced=toks)
        out.append(vs_model_py(dict(compare("runner", rf, rff, ref, steps),
                                    seconds=time.time() - t0), rf, rff, mp))
        log(fmt_cross(out[-1]))
    if with_swap:
        from deepseek_csa.transformers import swap, unswap
        t0 = time.time()
        m = m or load_hf(root / "hf-bf16", threads)
        swap(m)
        sw, swf = hf_logits(m, prompt, steps), hf_logits(m, prompt, steps, forced=toks)
        unswap(m)
        out.append(vs_model_py(dict(compare("hf + swap", sw, swf, ref, steps),
                                    seconds=time.time() - t0), sw, swf, mp))
        log(fmt_cross(out[-1]))
        del m
        t0 = time.time()
        m = load_hf(root / "hf-bf16", threads, swapped=True, bf16=True)
        sw, swf = hf_logits(m, prompt, steps), hf_logits(m, prompt, steps, forced=toks)
        out.append(vs_model_py(dict(compare("hf + swap bf16", sw, swf, ref, steps),
                                    seconds=time.time() - t0), sw, swf, mp))
        log(fmt_cross(out[-1]))
        # the same model on the checkpoint's FP8 / FP4 codes: the released Linear's
        # arithmetic (e4m3 activations), so its distance from eager is that rounding's
        from deepseek_csa.transformers import quantize
        t0 = time.time()
        quantize(m)
        sw, swf = hf_logits(m, prompt, steps), hf_logits(m, prompt, steps, forced=toks)
        out.append(vs_model_py(dict(compare("hf + swap fp8", sw, swf, ref, steps),
                                    seconds=time.time() - t0), sw, swf, mp))
        log(fmt_cross(out[-1]))
    del m
    for name in variants:
        name, gg, extra = LLAMA_VARIANTS[name]
        if gg != "model.gguf":
            convert_gguf(root / "hf", root / gg, variant=gg[len("model-"):-len(".gguf")], log=log)
        env = dict(llama_env(ggml), **extra)
        t0 = time.time()
        ll, _ = llama_logits(root / gg, prompt, steps, threads, env=env)
        llf, _ = llama_logits(root / gg, prompt, steps, threads, forced=toks, env=env)
        out.append(vs_model_py(dict(compare(name, ll, llf, ref, steps), seconds=time.time() - t0,
                                    ggml=ggml, gguf=gg, env=extra), ll, llf, mp))
        log(fmt_cross(out[-1]))
    for r in out:
        r.update(prompt_len=prompt_len, ref_tokens=toks)
    return out


def fmt_cross(r):
    return (f"cross     {r['side']:<48} last-logits rel err {r['last_logits_rel_err']:.2e} | "
            f"greedy {r['greedy_same']}/{r['steps']} same (common prefix "
            f"{r['greedy_common_prefix']}) | forced: argmax {r['forced_argmax_agree']}/"
            f"{r['steps']}, rel err median {r['forced_rel_err_median']:.2e} max "
            f"{r['forced_rel_err_max']:.2e} | ref min top-2 gap {r['ref_top2_gap_min']:.3f}"
            + "".join(f" | flip@{f['step']}: ref margin {f['margin']:.3f}, max |dlogit| "
                      f"{f['logit_err_max']:.3f}" for f in r.get("forced_flips", []))
            + ("" if "vs_model_py" not in r else
               f"\n          vs released model.py: last-logits rel err "
               f"{r['vs_model_py']['last_logits_rel_err']:.2e} | greedy "
               f"{r['vs_model_py']['greedy_same']}/{r['steps']} same (common prefix "
               f"{r['vs_model_py']['greedy_common_prefix']}) | forced: argmax "
               f"{r['vs_model_py']['forced_argmax_agree']}/{r['steps']}, rel err median "
               f"{r['vs_model_py']['forced_rel_err_median']:.2e} max "
               f"{r['vs_model_py']['forced_rel_err_max']:.2e}"
               + "".join(f" | flip@{f['step']}: model.py margin {f['margin']:.3f}, max "
                         f"|dlogit| {f['logit_err_max']:.3f}"
                         for f in r["vs_model_py"]["forced_flips"])))


# ---------------------------------------------------------------- rows
ROWS_FULL = [("prefill", 512, 0), ("prefill", 2048, 0), ("prefill", 8192, 0),
             ("decode", 4096, 16), ("decode", 32768, 8)]
ROWS_QUICK = [("decode", 4096, 16)]


def weight_formats(root, ggml):
    import collections
    t = gguf_tensor_types(root / "model.gguf")
    by = collections.defaultdict(set)
    for name, ty in t.items():
        kind = ("routed experts" if "_exps" in name else "router" if "tid2eid" in name
                else "shared experts" if "shexp" in name else "indexer" if "indexer" in name else "embed/head" if name.startswith(
                    ("token_embd", "output.")) else "router" if "gate_inp" in name
                else "compressors" if "compressor" in name else "hyper-connections"
                if "hc_" in name else "norms/sinks/bias" if "norm" in name or "sinks" in name
                or "exp_probs" in name else "attention")
        by[kind].add(ty)
    llama = "; ".join(f"{k} {'/'.join(sorted(v))}" for k, v in sorted(by.items()))
    buf = {"noamx": "MXFP4 in CPU_REPACK, the rest plain CPU buffers (ggml AVX-512 without AMX)",
           "native": "llama.cpp's default buffers (AMX for Q8_0, CPU_REPACK for MXFP4)",
           "native-noextra": "every weight in plain CPU buffers",
           "avx2": "MXFP4 in CPU_REPACK, the rest plain CPU buffers (ggml limited to AVX2)"}[ggml]
    return {"llama.cpp": f"{llama}; {buf}; K/V cache F16 (default); activations into "
                         "Q8_0 / MXFP4 mul_mat quantized to Q8_0",
            "hf eager": "float32 throughout (FP8 / FP4 weights dequantized exactly); "
                        "K/V float32",
            "hf + swap": "float32 throughout (same module weights); our kernels for "
                         "attention / indexer / compressor",
            "hf + swap bf16": "bfloat16 weights (the FP8 / FP4 values, exact), activations "
                              "and K/V; our kernels for attention / indexer / compressor",
            "hf + swap fp8": "the checkpoint's FP8 e4m3 / FP4 e2m1 codes for its FP8 / FP4 "
                             "projections (deepseek_csa.transformers.quantize: fp8_gemm / "
                             "fp4_gemm, activations e4m3 per 128 as the released Linear), "
                             "the rest bf16; our kernels for attention / indexer / compressor",
            "runner": "the released model.py's formats: FP8 e4m3 (e8m0 block scales) and "
                      "FP4 e2m1 weights in place (fp8_gemm / fp4_gemm, activations e4m3 "
                      "per 128), wo_a bf16 (convert.py widens it), compressors / norms / "
                      "head float32, bf16 activations and K/V, its QAT roundings"}


def fmt_row(r):
    parts = []
    for side in r["sides"]:
        v = r.get(side)
        if not v:
            continue
        rss = (f", {v['rss_end_bytes'] / 2**30:.2f} at the end" if v.get("rss_end_bytes")
               else "")
        parts.append(f"{side} {v['tokens_per_s']:8.2f} tok/s ({v['peak_rss_bytes'] / 2**30:.2f} GiB"
                     f"{rss})")
    ratio = r.get("swap_over_llama")
    return (f"model     {r['kind']:<7} {r['label']:<40} | " + " | ".join(parts)
            + (f" | {r['swap_best']} / llama.cpp x{ratio:.2f}" if ratio else "")
            + f" | runner: {r['runner_note']} | {r['cpu']} {r.get('isa', '')} {r['threads']}t "
              f"({r['rounds']} rounds, load {r.get('load_avg_1min', 0):.1f})")


def measure_rows(root, plan, sides, rounds, threads, ggml, chunk, runner, log=print):
    rows = []
    for kind, n, k in plan:
        raw = {s: [] for s in sides}
        for rd in range(rounds):
            order = sides if rd % 2 == 0 else sides[::-1]
            for s in order:
                raw[s].append(run_side(s, root, threads, n, k, ggml=ggml, chunk=chunk,
                                       runner=runner))
        label = f"N={n}" if kind == "prefill" else f"ctx={n}, {k} steps"
        label += f" (hf chunks {hf_chunk(n, chunk)})" if n > hf_chunk(n, chunk) else ""
        r = dict(kind=kind, n=n, steps=k, label=label, sides=list(sides), rounds=rounds, raw=raw)
        for s in sides:
            key = "prefill_s" if kind == "prefill" else "decode_s"
            sec = statistics.median(x[key] for x in raw[s])
            r[s] = dict(seconds=sec, tokens_per_s=(n if kind == "prefill" else k) / sec,
                        peak_rss_bytes=max(x["peak_rss_bytes"] for x in raw[s]),
                        process_cpu_s=statistics.median(x["process_cpu_s"] for x in raw[s]))
            if all(x.get(key.replace("_s", "_cpu_s")) is not None for x in raw[s]):
                # the runner's own CPU time of the phase (all threads), beside its wall time
                r[s]["cpu_s"] = statistics.median(x[key.replace("_s", "_cpu_s")] for x in raw[s])
            if all("rss_end_bytes" in x for x in raw[s]):     # transformers sides
                r[s]["rss_end_bytes"] = max(x["rss_end_bytes"] for x in raw[s])
        swaps = [x for x in ("hf + swap", "hf + swap bf16", "hf + swap fp8") if x in r]
        if swaps and "llama.cpp" in r:
            best = max(swaps, key=lambda x: r[x]["tokens_per_s"])
            r["swap_over_llama"] = r[best]["tokens_per_s"] / r["llama.cpp"]["tokens_per_s"]
            r["swap_best"] = best
        rows.append(r)
    return rows


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, kind in zip(axes, ("prefill", "decode")):
        rs = [r for r in rows if r["kind"] == kind]
        for side, mk in (("llama.cpp", "s"), ("hf eager", "o"), ("hf + swap", "^"),
                         ("hf + swap bf16", "v"), ("hf + swap fp8", "P"),
                         ("hf + swap compile", "*"), ("runner", "D")):
            pts = [(r["n"], r[side]["tokens_per_s"]) for r in rs if isinstance(r.get(side), dict)]
            if pts:
                ax.plot(*zip(*pts), marker=mk, label=side,
                        ls="--" if side == "llama.cpp" else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens" if kind == "prefill" else "context tokens before decoding")
        ax.set_ylabel("tokens/s")
        ax.set_title(kind)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, f"no {kind} rows in this run", ha="center",
                    transform=ax.transAxes)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_snapshot(snap, path):
    sides = [x for x in dict.fromkeys(x for r in snap["rows"] for x in r["sides"])
             if x != "llama.cpp"]
    plot(snap["rows"], path,
         f"V4-Flash-width 3-layer model, {snap['cpu']}, {snap['threads']} threads: llama.cpp "
         f"{snap['llamacpp_version']} ({snap['ggml']}) vs "
         + (" / ".join(sides) or "transformers eager / + deepseek_csa swap"))


# ---------------------------------------------------------------- main
def prepare(log=print):
    """Model + GGUF (cached); raises FileNotFoundError when `make peers` is missing."""
    if not (LLAMA_TREE / "convert_hf_to_gguf.py").exists() or not harness_path().exists():
        raise FileNotFoundError(
            f"{harness_path()} or {LLAMA_TREE} not found: run `PEERS_EXTRA_TARGETS=llama make "
            f"peers` (and PEERS_GGML_ISA=noamx make peers on an AMX host) first")
    root = MODEL_CACHE / model_key()
    write_model(root, log=log)
    how = convert_gguf(root / "hf", root / "model.gguf", log=log)
    return root, how


def bench_summary(snap):
    """[(row, met, note)] for bench_llamacpp.py's `llamacpp: N/M rows ours >= llama.cpp`:
    each timed row compares "ours" = our runner when it ran, else transformers + swap,
    with llama.cpp; the cross-engine row is met when the swap agrees with the reference
    to float rounding and llama.cpp's deviation is the one docs/peers.md section 7
    explains (Q8_0 weights / activations, F16 K/V: every forced argmax that differs is a
    near-tie of the reference, margin below llama.cpp's largest logit error there)."""
    out = []
    for r in snap.get("rows", []):
        ours = ("runner" if isinstance(r.get("runner"), dict) else
                max((x for x in ("hf + swap", "hf + swap bf16", "hf + swap fp8")
                     if isinstance(r.get(x), dict)),
                    key=lambda x: r[x]["tokens_per_s"], default="hf + swap"))
        if isinstance(r.get(ours), dict) and isinstance(r.get("llama.cpp"), dict):
            x = r[ours]["tokens_per_s"] / r["llama.cpp"]["tokens_per_s"]
            out.append((f"model {r['kind']} {r['label']}", x >= 1,
                        f"{ours} / llama.cpp x{x:.2f}"))
    cross = {c["side"]: c for c in snap.get("cross_engine", [])}
    if cross:
        sw, ll = cross.get("hf + swap"), cross.get("llama.cpp")
        ok_sw = sw is not None and sw["forced_rel_err_max"] < 1e-5 and sw["greedy_same"] == sw["steps"]
        flips = (ll or {}).get("forced_flips")
        ok_ll = ll is not None and (ll["forced_argmax_agree"] == ll["steps"] if flips is None
                                    else all(f["margin"] < f["logit_err_max"] for f in flips))
        out.append(("model cross-engine", ok_sw and ok_ll,
                    f"swap {sw and sw['forced_rel_err_max']:.1e}; llama.cpp "
                    f"{ll and ll['last_logits_rel_err']:.1e}, forced argmax "
                    f"{ll and ll['forced_argmax_agree']}/{ll and ll['steps']} (docs/peers.md s. 7)"))
    return out


def main(argv=None):
    snap = run(argv)
    return 0 if snap is None or isinstance(snap, dict) else snap


def run(argv=None):
    """Everything main() does; returns the snapshot dict (None when skipped)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)))
    ap.add_argument("--quick", action="store_true",
                    help="decode row at 4K context + the cross-engine row (no diagnostics)")
    ap.add_argument("--check-only", action="store_true", help="only the cross-engine rows")
    ap.add_argument("--no-check", action="store_true", help="only the timed rows")
    ap.add_argument("--rounds", type=int, default=0,
                    help="interleaved rounds per row (0: 2, --quick 1; ctx 32K always 1)")
    ap.add_argument("--prompt-len", type=int, default=2304,
                    help="cross-engine prompt (2304: 576 compressed CSA entries > top-512)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--variants", default="",
                    help="comma-separated llama.cpp cross-engine variants (default: the row "
                         "only with --quick, all without; 'none': no llama.cpp); names: "
                         + ", ".join(LLAMA_VARIANTS))
    ap.add_argument("--reuse-ref", action="store_true",
                    help="cross-engine: reuse the cached transformers-eager reference logits")
    ap.add_argument("--no-swap-check", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ggml", default=None, choices=["noamx", "native", "native-noextra", "avx2"],
                    help="llama.cpp's ggml (default: noamx when built, else native on a "
                         "CPU without AMX, native-noextra with AMX)")
    ap.add_argument("--chunk", type=int, default=2048, help="transformers prefill chunk")
    ap.add_argument("--sides", default="", help="comma-separated subset of: llama.cpp, "
                    "hf eager, hf + swap, hf + swap bf16, hf + swap fp8, hf + swap compile "
                    "(runner is added by --inference-dir)")
    ap.add_argument("--rows", default="", help="custom rows, e.g. prefill:512,decode:4096:16")
    ap.add_argument("--inference-dir", help="DeepSeek's inference/ (model.py, convert.py) for "
                    "our runner and the released-model.py reference (default: where "
                    "tests/released_files.py finds it)")
    ap.add_argument("--runner-ckpt", help="hf/ converted by that folder's convert.py (default: "
                    "converted once under build/peers/model27/<key>/runner-<sha>/)")
    ap.add_argument("--runner-config", help="that folder's ModelArgs config.json for this model")
    ap.add_argument("--out", default=None,
                    help="JSON path (default benchmarks/results/llamacpp_model.json)")
    ap.add_argument("--note", default="")
    ap.add_argument("--replot", metavar="JSON",
                    help="only redraw the PNG of a snapshot this script wrote (next to it)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--n-prompt", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--n-decode", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.replot:
        snap = json.loads(Path(a.replot).read_text())
        plot_snapshot(snap, Path(a.replot).with_suffix(".png"))
        print(f"wrote {Path(a.replot).with_suffix('.png')}")
        return snap
    if a.worker:
        hf_worker(a.worker, MODEL_CACHE / model_key() / "hf-bf16", a.threads, a.n_prompt,
                  a.n_decode, a.chunk)
        return None
    import harness
    try:
        root, how = prepare()
    except FileNotFoundError as e:
        print(f"SKIP bench_llamacpp_model: {e}")
        return None
    ggml = a.ggml or default_ggml()
    cpu = harness.cpu_model()
    runner = None
    inference_dir, where = (a.inference_dir, a.inference_dir) if a.inference_dir else find_inference_dir()
    runner_note = (f"not run: DeepSeek's released inference/model.py not found at {where} "
                   "(tests/released_files.py; --inference-dir DIR)")
    if inference_dir:
        runner = (dict(inference_dir=inference_dir, ckpt=a.runner_ckpt, config=a.runner_config)
                  if a.runner_ckpt else prepare_runner(root, inference_dir))
        runner_note = (f"python -m deepseek_csa.generate on {inference_dir}/model.py, "
                       f"checkpoint {runner['ckpt']} (its convert.py)")
    sides = (["llama.cpp", "hf eager", "hf + swap", "hf + swap bf16", "hf + swap fp8"]
             + (["runner"] if runner else []))
    if a.sides:
        sides = [x.strip() for x in a.sides.split(",")]
    t_start = time.time()
    print(f"model27: {root} ({json.dumps({k: MODEL[k] for k in ('hidden_size', 'num_hidden_layers', 'compress_ratios', 'n_routed_experts', 'num_experts_per_tok', 'vocab_size')})}); "
          f"GGUF: {how}; llama.cpp ggml: {ggml}; {cpu}, {a.threads} threads", flush=True)
    rows, cross = [], []
    if not a.check_only:
        plan = ROWS_QUICK if a.quick else ROWS_FULL
        if a.rows:
            plan = [(f[0], int(f[1]), int(f[2]) if len(f) > 2 else 0)
                    for f in (x.split(":") for x in a.rows.split(","))]
        rounds = a.rounds or (1 if a.quick else 2)
        for item in plan:
            rr = measure_rows(root, [item], sides, 1 if item[1] >= 32768 else rounds,
                              a.threads, ggml, a.chunk, runner)
            for r in rr:
                r.update(cpu=cpu, threads=a.threads, runner_note=runner_note,
                         isa=harness.environment(a.threads)["isa"],
                         omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
                         load_avg_1min=os.getloadavg()[0])
                print(fmt_row(r), flush=True)
            rows += rr
    if not a.no_check:
        variants = ["default"] if a.quick else list(LLAMA_VARIANTS)
        if a.variants:
            variants = [v.strip() for v in a.variants.split(",") if v.strip() != "none"]
        cross = cross_engine(root, a.threads, a.prompt_len, a.steps, ggml, variants,
                             reuse_ref=a.reuse_ref, with_swap=not a.no_swap_check,
                             runner=runner)
    formats = weight_formats(root, ggml)
    for k, v in formats.items():
        print(f"formats   {k:<10} {v}")
    snap = dict(note=f"benchmarks/bench_llamacpp_model.py{' --quick' if a.quick else ''}: "
                     "a V4-Flash-width 3-layer random model; llama.cpp (libllama harness) vs "
                     "transformers eager vs transformers + deepseek_csa swap. " + a.note,
                llamacpp_version=LLAMACPP_VERSION, model=MODEL, model_key=model_key(),
                head_gain=HEAD_GAIN, seed=SEED, gguf=how, ggml=ggml, cpu=cpu,
                threads=a.threads, env=harness.environment(a.threads), host=platform.node(),
                runner=runner_note, weight_formats=formats, rows=rows, cross_engine=cross,
                reference=("transformers eager float32; vs_model_py: DeepSeek's released "
                           "model.py in plain PyTorch (bf16, float32 torch stand-ins of its "
                           "kernel module)" if runner else "transformers eager float32 "
                           "(DeepSeek's released model.py not found)"),
                seconds=time.time() - t_start)
    out = Path(a.out) if a.out else harness.RESULTS / "llamacpp_model.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(snap, indent=1, default=float))
    if rows:
        plot_snapshot(snap, out.with_suffix(".png"))
    print(f"wrote {out} ({time.time() - t_start:.0f} s)")
    summ = bench_summary(snap)
    for name, ok, note in summ:
        print(f"summary   {name:<52} {'met' if ok else 'NOT met'}: {note}")
    if summ:
        print(f"llamacpp_model: {sum(ok for _, ok, _ in summ)}/{len(summ)} rows met "
              f"(ours = {'runner' if runner else 'transformers + swap'})")
    return snap


if __name__ == "__main__":
    sys.exit(main())
