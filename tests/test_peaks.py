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


@pytest.mark.parametrize("level", LEVELS, indirect=True)
def test_idot_peak_shape_and_count(level):
    """The integer dot-product peak runs the FP4 indexer's instruction at the level:
    VPDPBUSD (zmm) at avx512 / amx where the CPU has AVX512_VNNI, VPMADDUBSW pairs
    added into int16 lanes by VPADDW at avx2 (ymm) and avx512 without it (zmm), scalar below; it
    counts 2 ops a byte product, and its chains fit the register file."""
    dc.set_isa(level)
    sh = _core._peak_idot_shape()
    assert sh["isa"] == level
    vnni = level in ("avx512", "amx") and "vnni_vbmi" in dc.build_info()["cpu_features"].split()
    if vnni:
        assert (sh["instruction"], sh["vec_bytes"]) == ("vpdpbusd", 64)
        per_round = sh["accumulators"] * 64 * 2
    elif level in ("avx2", "avx512", "amx"):
        assert (sh["instruction"], sh["vec_bytes"]) == ("vpmaddubsw+vpaddw", WIDTH[level])
        per_round = sh["accumulators"] * 2 * sh["vec_bytes"] * 2   # two VPMADDUBSW a chain
    else:
        assert (sh["instruction"], sh["vec_bytes"]) == ("scalar", 4)
        per_round = sh["accumulators"] * 2
    if level not in ("ref", "base"):
        # VPDPBUSD latency 5 on one or two ports: >= 5 chains, no spills
        assert 5 <= sh["accumulators"] <= REGS[level] - 4
    assert _core._peak_idot(1000, 1) == 1000 * per_round
    ran = 1 if level == "ref" or not dc.build_info()["openmp"] else 2  # 'ref': one chain
    assert _core._peak_idot(1000, 2) == ran * 1000 * per_round
