"""deepseek_csa: DeepSeek-V4 / V4.1 Compressed Sparse Attention kernels for the CPU.

Every kernel takes NumPy arrays (or CPU torch tensors, without copying), validates
them, releases the GIL and runs C code parallelized with OpenMP; thread counts follow
OMP_NUM_THREADS and threadpoolctl, and results are bitwise identical at any thread
count.  docs/kernels.md says what each computes, docs/architecture.md how the package
is built.

ISA levels (``ISA_LEVELS``, lowest first): 'ref' runs the scalar oracles, the others
the tuned kernels compiled for that level; ``set_isa`` / the DEEPSEEK_CSA_ISA
environment variable cap the level at what the CPU has.
"""
import os as _os
import warnings as _warnings

from . import _core
from ._core import (ISA_LEVELS, apply_rope, best_isa, get_isa, max_threads, rms_norm,
                    rms_norm_backward, rope_table, set_isa)
from .configs import V4_FLASH, V4_PRO, V41_FLASH, CSAConfig
from .compressor import *  # noqa: F401,F403  gated_pool, Compressor
from .indexer import *  # noqa: F401,F403  index_scores, index_topk, ...
from .attention import *  # noqa: F401,F403  sparse_attn
from .quant import *  # noqa: F401,F403  fp8_round, fp4_round, hadamard
from .gemm import *  # noqa: F401,F403  fp8_gemm, fp4_gemm, fp8_quant, fp4_quant, ...
from . import compressor as _c, indexer as _i, attention as _a, quant as _q, gemm as _g

__version__ = "0.1.0"


def build_info():
    """How the C module was built: {'openmp': bool, 'openmp_version': int or None,
    'compiler': str, 'arch': str, 'isa_levels': [levels compiled in]}."""
    info = _core._build_info()
    info["isa_levels"] = info["isa_levels"].split()
    return info


if not _core._build_info()["openmp"]:
    import warnings as _warnings
    _warnings.warn("deepseek_csa was built without OpenMP (the C compiler could not build "
                   "OpenMP code): every kernel runs on ONE thread.  Reinstall with an "
                   "OpenMP-capable compiler (GCC, or clang with libomp) for threads.",
                   RuntimeWarning, stacklevel=2)

_env_isa = _os.environ.get("DEEPSEEK_CSA_ISA", "")
if _env_isa and _env_isa not in ISA_LEVELS:
    # the C runtime ignores a value it does not know (kernels never print): say so here
    _warnings.warn(f"DEEPSEEK_CSA_ISA={_env_isa!r} is not one of {ISA_LEVELS}; it is ignored "
                   f"and kernels run at {get_isa()!r}, the best level of this CPU",
                   RuntimeWarning, stacklevel=2)
del _env_isa

_env_features = _os.environ.get("DEEPSEEK_CSA_CPU_FEATURES")
if _env_features is not None and set(_env_features.replace(",", " ").split()) - {
        "vnni_vbmi", "bf16", "amx_int8", "none"}:
    _warnings.warn(f"DEEPSEEK_CSA_CPU_FEATURES={_env_features!r} names something other than "
                   f"'vnni_vbmi', 'bf16', 'amx_int8' or 'none'; only those are kept, and only where the CPU "
                   f"has them (now: {_core._build_info()['cpu_features']!r})",
                   RuntimeWarning, stacklevel=2)
del _env_features

__all__ = (["apply_rope", "rms_norm", "rms_norm_backward", "rope_table", "get_isa", "set_isa", "best_isa",
            "max_threads", "build_info", "ISA_LEVELS", "V4_FLASH", "V4_PRO", "V41_FLASH",
            "CSAConfig"] + _c.__all__ + _i.__all__ + _a.__all__ + _q.__all__ + _g.__all__)
