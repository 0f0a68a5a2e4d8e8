"""benchmarks/bench_released_width.py without its 3.6 GB model: the skip path, the bytes a
decode step must read (counted here from the released formats, independently of the
script's tensor plan), the random FP4 experts' scale, and its ModelArgs config against
the released model.py's fields."""
import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_released_width",
                                              ROOT / "benchmarks" / "bench_released_width.py")
bw = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bw)

torch = pytest.importorskip("torch")


def test_skips_without_the_build(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bw.blm, "LLAMA_TREE", tmp_path / "llama.cpp")
    monkeypatch.setattr(bw, "inference_dir", lambda: tmp_path)
    assert bw.main([]) == 0
    assert capsys.readouterr().out.startswith("SKIP bench_released_width:")


def test_must_bytes_of_the_released_layout():
    """V4-Flash's layer: FP8 = 1 byte + one ue8m0 byte per 128 x 128 block; FP4 = half a
    byte + one ue8m0 byte per 32; bf16 2 bytes; K/V bf16."""
    fp8 = lambda n, k: n * k + (n // 128) * (k // 128)      # noqa: E731
    fp4 = lambda n, k: n * k // 2 + n * k // 32              # noqa: E731
    m = bw.must_bytes(65536)
    assert m["routed experts (6 of 256)"] == 6 * (2 * fp4(2048, 4096) + fp4(4096, 2048))
    assert m["shared expert"] == 2 * fp8(2048, 4096) + fp8(4096, 2048)
    # wq_a, wq_b, wkv, wo_a, wo_b (FP8) + attn/ffn norms, q/kv norms (f32), sinks (f32)
    attn = (fp8(1024, 4096) + fp8(64 * 512, 1024) + fp8(512, 4096) + fp8(8 * 1024, 4096)
            + fp8(4096, 8 * 1024) + 4 * (2 * 4096 + 1024 + 512 + 64))
    assert m["attention"] == attn
    # the compressor's wkv / wgate in bf16 (as released), its ape and norm in float32
    assert m["compressor"] == 2 * 1024 * 4096 * 2 + 4 * (4 * 1024 + 512)
    assert m["attention K/V (window + top-512)"] == (128 + 512) * 512 * 2
    assert m["index keys"] == 16384 * 128 * 2
    assert bw.must_bytes(4096)["index keys"] == 1024 * 128 * 2
    assert 245e6 < sum(m.values()) < 265e6                   # the issue's ~200 MB + caches


def test_random_fp4_experts_have_the_planned_std():
    rng = np.random.default_rng(0)
    codes, scales = bw._fp4_random(rng, (256, 4096), 4096 ** -0.5)
    c = codes.numpy().view(np.uint8)
    e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    vals = e2m1[np.stack([c & 15, c >> 4], -1).reshape(256, 4096)]
    sc = np.exp2(scales.view(torch.uint8).numpy().astype(np.float32) - 127)
    w = vals * np.repeat(sc, 32, 1)
    assert 0.5 < w.std() * 64 < 1.5


def test_runner_config_fills_model_args():
    import released_files as rf
    import deepseek_csa.torch as dct
    mod = dct.load_model_py(rf.v4_model_py())
    fields = {f.name for f in dataclasses.fields(mod.ModelArgs)}
    cfg = bw.runner_config()
    assert set(cfg) <= fields, set(cfg) - fields
    assert cfg["n_routed_experts"] == 256 and cfg["n_layers"] == 1 and cfg["n_mtp_layers"] == 0
