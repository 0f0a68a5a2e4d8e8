"""DeepSeek's released V4 ``inference/convert.py`` -> deepseek_csa.generate, the runner.

A tiny FP8 / FP4 Transformer of the released V4 ``model.py`` (found, with convert.py
beside it, by ``released_files``: ``<repo>/../shared/reference/deepseek-v4/inference/``
or the folder of DEEPSEEK_MODEL_PY; skipped, saying where, when absent) is written as a
checkpoint in the layout convert.py reads (the model's tensor names; the grouped
``wo_a`` as FP8 codes with 128 x 128 block scales, which convert.py dequantizes to
bf16; the routed experts' FP4 codes as int8, which it views as float4_e2m1fn_x2).  The
released convert.py runs on it unchanged, in a subprocess (it sets torch's thread count
for its process); its ``model0-mp1.safetensors`` is then

* loaded by ``deepseek_csa.generate.load_checkpoint`` into a fresh model: every tensor
  bit for bit what the model holds (FP8 / FP4 kept, ``wo_a`` the exact bf16 of its
  codes times scales);
* run by the runner's command line (``python -m deepseek_csa.generate --inference-dir
  <the released folder>``): its greedy tokens and prefill logits equal, bit for bit, an
  in-process ``generate`` of the original model on the same kernels.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import ref_layer as R
import released_files as rf
import test_kernel_module as TK
from test_model_py import V4_FP8

import deepseek_csa.torch as dct
from deepseek_csa import generate as G
from deepseek_csa.torch import kernel_module as K

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 17, 42, 3, 88, 61, 9, 100, 7], [70, 2, 33, 14, 50, 27, 81, 64, 12]]
NEW = 5


@pytest.fixture(scope="module")
def v4():
    path = rf.v4_model_py()
    rf.v4_convert_py()
    with K.preserved_modules(("kernel", "fast_hadamard_transform")):
        yield dct.load_model_py(path)


def _fp8_blocks(w):
    """w [N, K] (N, K multiples of 128) -> (e4m3 codes, e8m0 scales [N/128, K/128]):
    power-of-two block scales, so codes * scales is exact in bf16."""
    n, k = w.shape
    blocks = w.float().view(n // 128, 128, k // 128, 128)
    s = R._pow2_at_least(blocks.abs().amax((1, 3)).clamp_min(1e-4) / 448.0)
    q = (blocks / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(n, k), TK._e8m0_bits(s).view(torch.float8_e8m0fnu)


def _model(v4):
    """The tiny FP8 / FP4 model, its ``wo_a`` on the FP8 grid convert.py produces."""
    model = TK.build(v4, seed=21, **V4_FP8)
    hf = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("wo_a.weight"):
                q, s = _fp8_blocks(t)
                hf[name], hf[name.replace("weight", "scale")] = q, s
                deq = (q.float().view(q.shape[0] // 128, 128, q.shape[1] // 128, 128)
                       * TK.KM.e8m0_float(s)[:, None, :, None]).view(q.shape)
                t.copy_(deq.to(t.dtype))
                assert torch.equal(t.float(), deq)       # exact in bf16
            elif t.dtype == torch.float4_e2m1fn_x2:
                hf[name] = t.view(torch.int8).clone()    # the checkpoint's int8 FP4 codes
            else:
                hf[name] = t.detach().clone()
    return model, hf


@pytest.fixture(scope="module")
def converted(v4, tmp_path_factory):
    from safetensors.torch import save_file
    root = tmp_path_factory.mktemp("convert")
    model, hf = _model(v4)
    names = sorted(hf)
    (root / "hf").mkdir()
    # two files, as a real checkpoint is split (convert.py globs *.safetensors)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        save_file({k: hf[k].contiguous() for k in part},
                  str(root / "hf" / f"model-0000{i + 1}-of-00002.safetensors"))
    cmd = [sys.executable, rf.v4_convert_py(), "--hf-ckpt-path", str(root / "hf"),
           "--save-path", str(root / "mp1"), "--n-experts", str(V4_FP8["n_routed_experts"]),
           "--model-parallel", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(root))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (root / "config.json").write_text(json.dumps(V4_FP8))
    (root / "prompts.txt").write_text("\n".join(" ".join(map(str, q)) for q in PROMPTS))
    return root, model


def test_convert_output_loads_bit_for_bit(v4, converted):
    root, model = converted
    with TK.bf16_default():
        fresh = v4.Transformer(v4.ModelArgs(**V4_FP8))
    missing, unexpected = G.load_checkpoint(fresh, str(root / "mp1" / "model0-mp1.safetensors"),
                                            log=lambda *a: None)
    assert not missing and not unexpected, (missing, unexpected)
    want = model.state_dict()
    for k, v in fresh.state_dict().items():
        assert v.dtype == want[k].dtype, k
        a = v.view(torch.uint8) if v.element_size() == 1 else v
        b = want[k].view(torch.uint8) if v.element_size() == 1 else want[k]
        assert torch.equal(a, b), k
    assert fresh.layers[0].ffn.experts[0].w1.weight.dtype == torch.float4_e2m1fn_x2
    assert fresh.layers[1].attn.wo_a.weight.dtype == torch.bfloat16


def test_runner_on_convert_output_equals_in_process(v4, converted):
    root, model = converted
    out = root / "out.json"
    cmd = [sys.executable, "-m", "deepseek_csa.generate",
           "--inference-dir", os.path.dirname(rf.v4_model_py()),
           "--ckpt-path", str(root / "mp1"), "--config", str(root / "config.json"),
           "--input-file", str(root / "prompts.txt"), "--max-new-tokens", str(NEW),
           "--output-json", str(out), "--output-logits",
           # the released arithmetic, as the in-process run below has it (the runner's
           # defaults read wo_a as FP8 and float32 weights as bf16, which
           # tests/test_model_py.py compares with the released einsums)
           "--wo-a", "bf16", "--f32-weights", "f32"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = json.loads(out.read_text())
    with TK.bf16_default():
        outs, st = G.generate(model, PROMPTS, NEW)
    assert got["tokens"] == outs
    assert torch.equal(torch.tensor(got["prefill_logits"]), st["prefill_logits"].float())
