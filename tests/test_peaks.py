"""The machine-ceiling probes behind benchmarks/: per ISA level, the FMA peak uses the
level's vector width with an accumulator count that fits the register file, counts its
flops right, and there is no AMX peak below level amx."""
import pytest

import deepseek_csa as dc
from deepseek_csa import _core

LEVELS = [l for l in ("ref", "base", "avx2", "avx512", "amx")
          if ["ref", "base", "avx2", "avx512", "amx"].index(l)
          <= ["ref", "base", "avx2", "avx512", "amx"].index(dc.best_isa())]
# vector registers of each level's register file (x86: 16 xmm/ymm, 32 zmm; NEON: 32)
REGS = {"base": 16 if dc.build_info()["arch"] == "x86_64" else 32, "avx2": 16,
        "avx512": 32, "amx": 32}
WIDTH = {"ref": 4, "base": 16, "avx2": 32, "avx512": 64, "amx": 64}


@pytest.fixture
def level(request):
    before = dc.get_isa()
    yield request.param
    dc.set_isa(before)


@pytest.mark.parametrize("level", LEVELS, indirect=True)
def test_fma_shape_fits_registers(level):
    dc.set_isa(level)
    sh = _core._peak_fma_shape()
    assert sh["isa"] == level
    assert sh["vec_bytes"] == WIDTH[level]
    if level != "ref":
        # latency 4-5 x 2 ports needs >= 8 chains; + 2 constant vectors, no spills
        assert 8 <= sh["accumulators"] <= REGS[level] - 2
    lanes = sh["vec_bytes"] // 4
    flops = _core._peak_fma(1000, 1)
    assert flops == 1000 * sh["accumulators"] * lanes * 2


@pytest.mark.parametrize("level", LEVELS, indirect=True)
def test_no_amx_peak_below_amx(level):
    dc.set_isa(level)
    r = _core._peak_amx_bf16(10, 1)
    if level == "amx":
        assert r is not None and r > 0
    else:
        assert r is None
