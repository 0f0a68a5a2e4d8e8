"""benchmarks/bench_llamacpp_model.py without llama.cpp (CI has none): the skip path, the
FP8 / FP4 encodings of the released checkpoint layout (exact dequantization, ue8m0
scales), a tiny-width model written in that layout and loaded by transformers'
DeepseekV4ForCausalLM with no missing or unexpected keys (its deepseek_v4 conversion
mapping renames DeepSeek's tensor names), and the cross-engine bookkeeping."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_llamacpp_model",
                                              ROOT / "benchmarks" / "bench_llamacpp_model.py")
bm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bm)

torch = pytest.importorskip("torch")

# V4's layer kinds (llama.cpp's loader accepts only the ratios 0, 4 and 128), tiny widths
TINY = dict(bm.MODEL, hidden_size=128, num_attention_heads=2, head_dim=128,
            qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=64,
            moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
            index_n_heads=2, index_head_dim=64, index_topk=4, sliding_window=8,
            vocab_size=48, hc_mult=2, hc_sinkhorn_iters=3)


def test_skips_without_the_build(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bm, "HARNESS", tmp_path / "llamacpp_model")
    monkeypatch.setattr(bm, "LLAMA_TREE", tmp_path / "llama.cpp")
    assert bm.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SKIP bench_llamacpp_model:") and "make" in out


def test_fp8_blocks_exact():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((200, 300)) * 0.05).astype(np.float32)
    w[:128, :128] *= 100                                   # blocks of very different range
    q, s, deq = bm.quant_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert tuple(s.shape) == (2, 3)
    e = s.view(torch.uint8).numpy().astype(np.float64) - 127
    sc = np.repeat(np.repeat(2.0 ** e, 128, 0), 128, 1)[:200, :300]
    assert np.array_equal(deq.astype(np.float64), q.float().numpy().astype(np.float64) * sc)
    assert np.abs(q.float().numpy()).max() <= 448
    assert np.abs(deq - w).max() <= np.abs(w).max() * 2 ** -3      # e4m3: 3 mantissa bits
    # bf16 holds the dequantized values exactly (what hf-bf16/ stores)
    assert np.array_equal(torch.from_numpy(deq).bfloat16().float().numpy(), deq)


def test_fp4_packing_exact():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    b, s, deq = bm.quant_fp4(w)
    assert b.dtype == torch.int8 and tuple(b.shape) == (16, 32) and tuple(s.shape) == (16, 2)
    u = b.view(torch.uint8).numpy()
    codes = np.stack([u & 15, u >> 4], -1).reshape(16, 64)          # element 2i low nibble
    want = bm.E2M1[codes] * np.repeat(2.0 ** (s.view(torch.uint8).numpy() - 127.0), 32, 1)
    assert np.array_equal(deq, want.astype(np.float32))
    assert np.array_equal(torch.from_numpy(deq).bfloat16().float().numpy(), deq)


def test_released_layout_loads_in_transformers(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from safetensors import safe_open
    from transformers import DeepseekV4ForCausalLM
    hf, hb = bm.write_model(tmp_path, TINY, log=lambda *a: None)
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["compress_ratios"] == [0, 4, 128] and cfg["quantization_config"]["scale_fmt"] == "ue8m0"
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("layers.1.attn.wq_b.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("layers.1.attn.wq_b.scale").dtype == torch.float8_e8m0fnu
        assert f.get_tensor("layers.2.ffn.experts.3.w2.weight").dtype == torch.int8
        assert f.get_tensor("layers.0.ffn.gate.tid2eid").dtype == torch.int32
    assert "layers.1.attn.indexer.compressor.ape" in keys and "layers.0.ffn.gate.bias" not in keys
    m, info = DeepseekV4ForCausalLM.from_pretrained(str(hb), dtype=torch.float32,
                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert m.config.layer_types == ["sliding_attention", "compressed_sparse_attention",
                                    "heavily_compressed_attention"]
    assert m.config.mlp_layer_types == ["hash_moe", "moe", "moe"]
    assert m.config.rope_parameters["compress"]["rope_type"] == "yarn"
    with safe_open(str(hb / "model.safetensors"), "pt") as f:
        want = f.get_tensor("layers.1.attn.wo_a.weight").float()
        w1 = f.get_tensor("layers.2.ffn.experts.1.w1.weight").float()
    assert torch.equal(m.model.layers[1].self_attn.o_a_proj.weight, want)
    assert torch.equal(m.model.layers[2].mlp.experts.gate_up_proj[1][:TINY["moe_intermediate_size"]], w1)
    # decisive logits: the head's gain spreads them well beyond float noise
    lg = m(torch.arange(2, 40)[None]).logits[0, -1]
    top2 = lg.topk(2).values
    assert lg.std() > 2 and top2[0] - top2[1] > 1e-3


def test_compare_counts():
    rng = np.random.default_rng(2)
    ref = rng.standard_normal((5, 10)).astype(np.float32)
    same = bm.compare("x", ref, ref, ref, 4)
    assert same["greedy_same"] == 4 and same["greedy_common_prefix"] == 4
    assert same["last_logits_rel_err"] == 0 and same["forced_argmax_agree"] == 4
    other = ref.copy()
    other[2] = -other[2]                                   # step 2's argmax moves
    r = bm.compare("y", other, other, ref, 4)
    assert r["greedy_common_prefix"] == 2 and r["greedy_same"] == 3
    assert r["forced_argmax_agree"] == 3


def test_bench_ids_deterministic_and_in_range():
    a = bm.bench_ids(1000, 512)
    assert a == bm.bench_ids(1000, 512) and len(a) == 1000
    assert min(a) >= 2 and max(a) < 512
    assert len(bm.bench_ids(8, 512)) == 8 and bm.bench_ids(8, 512) == a[:8]


def test_model_key_depends_on_config():
    assert bm.model_key() == bm.model_key(dict(bm.MODEL))
    assert bm.model_key() != bm.model_key(TINY) != bm.model_key(seed=1)


def test_bench_summary():
    row = {"kind": "decode", "label": "ctx=4096, 16 steps", "llama.cpp": {"tokens_per_s": 10.0},
           "hf + swap": {"tokens_per_s": 12.0}}
    flip = {"step": 1, "margin": 0.04, "logit_err_max": 0.5}
    snap = {"rows": [row, dict(row, **{"hf + swap": {"tokens_per_s": 5.0}})],
            "cross_engine": [
                {"side": "hf + swap", "forced_rel_err_max": 8e-7, "greedy_same": 32, "steps": 32},
                {"side": "llama.cpp", "last_logits_rel_err": 1.6e-2, "forced_argmax_agree": 31,
                 "steps": 32, "forced_flips": [flip]}]}
    got = bm.bench_summary(snap)
    assert [ok for _, ok, _ in got] == [True, False, True]
    # a flip where the reference was decisive is not explained by rounding: not met
    snap["cross_engine"][1]["forced_flips"] = [dict(flip, margin=2.0)]
    assert bm.bench_summary(snap)[-1][1] is False


def test_quantize_gives_back_the_released_codes(tmp_path):
    """transformers' loader dequantizes the released FP8 / FP4 tensors (and fuses the
    experts' w1 / w3); deepseek_csa.transformers.quantize puts every one back on codes
    without rounding anything, and its FP8 weights are the file's values."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    import deepseek_csa.transformers as dch
    if not dch._supported(__import__("transformers").__version__):
        pytest.skip("transformers version not supported by the bridge")
    from safetensors import safe_open
    from transformers import DeepseekV4ForCausalLM
    cfg = dict(TINY, o_lora_rank=128, moe_intermediate_size=128)   # the 128 blocks
    hf, hb = bm.write_model(tmp_path, cfg, log=lambda *a: None)
    m = DeepseekV4ForCausalLM.from_pretrained(str(hb), dtype=torch.bfloat16).eval()
    rep = dch.quantize(m)
    assert rep["rounded"] == [] and len(rep["fp4"]) == 3 and len(rep["fp8"]) == 3 * 8 + 1
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        codes = f.get_tensor("layers.1.attn.wq_b.weight").float()
        e = f.get_tensor("layers.1.attn.wq_b.scale").view(torch.uint8).long() - 127
    sc = torch.ldexp(torch.ones(e.shape), e).repeat_interleave(128, 0).repeat_interleave(128, 1)
    want = codes * sc[:codes.shape[0], :codes.shape[1]]
    assert torch.equal(m.model.layers[1].self_attn.q_b_proj.dequantized_weight(), want)
    with torch.no_grad():
        lg = m(torch.arange(2, 30)[None]).logits
    assert torch.isfinite(lg).all()


def test_runner_side_on_the_released_files(tmp_path):
    """The runner's side end to end on a tiny-width model: hf/ converted by the released
    convert.py (prepare_runner), runner_config() accepted field by field by the released
    ModelArgs, the shard loaded with no tensor missing on either side, and
    model_py_logits on our kernel module within the FP8 chaos budget of the released
    file on the float32 reference kernels (test_kernel_module.E2E_TOL: the two differ in
    last bits that flip FP8 codes downstream)."""
    pytest.importorskip("tokenizers")
    import dataclasses
    import released_files as rf
    import deepseek_csa.torch as dct
    from deepseek_csa import generate as G
    from deepseek_csa.torch.kernel_module import preserved_modules
    from test_kernel_module import E2E_TOL
    inference = str(Path(rf.v4_convert_py()).parent)
    # the released act_quant needs every GEMM's K a multiple of 128 (w2's: the expert width)
    TR = dict(TINY, moe_intermediate_size=128)
    bm.write_model(tmp_path, TR, log=lambda *a: None)
    monkey_cfg = bm.runner_config(TR, max_seq_len=256)
    runner = bm.prepare_runner(tmp_path, inference, log=lambda *a: None)
    Path(runner["config"]).write_text(json.dumps(monkey_cfg))
    with preserved_modules(("kernel", "fast_hadamard_transform")):
        mod = dct.load_model_py(inference)
    assert set(monkey_cfg) <= {f.name for f in dataclasses.fields(mod.ModelArgs)}
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        args, unknown = G.read_config(runner["config"], mod.ModelArgs)
        m = mod.Transformer(args)
        missing, unexpected = G.load_checkpoint(m, G.shard_path(runner["ckpt"], 0, 1),
                                                log=lambda *a: None)
    finally:
        torch.set_default_dtype(prev)
    assert not unknown and not missing and not unexpected, (unknown, missing, unexpected)
    prompt = bm.bench_ids(20, TR["vocab_size"])
    ours = bm.model_py_logits(runner, prompt, 2, 1)
    ref = bm.model_py_logits(runner, prompt, 2, 1, reference=True)
    assert ours.shape == ref.shape == (3, TR["vocab_size"]) and np.isfinite(ours).all()
    assert bm.rel_err(ours[0], ref[0]) < E2E_TOL, bm.rel_err(ours[0], ref[0])
