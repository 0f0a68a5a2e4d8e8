"""deepseek_csa: DeepSeek-V4 / V4.1 Compressed Sparse Attention kernels for the CPU.

Every kernel takes NumPy arrays (or CPU torch tensors, without copying), validates
them, releases the GIL and runs C code parallelized with OpenMP; thread counts follow
OMP_NUM_THREADS and threadpoolctl, and results are bitwise identical at any thread
count.  See SPEC.md for what each computes.
"""
from . import _core
from ._core import apply_rope, best_isa, get_isa, max_threads, rms_norm, rope_table, set_isa
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

__all__ = (["apply_rope", "rms_norm", "rope_table", "get_isa", "set_isa", "best_isa",
            "max_threads", "build_info", "V4_FLASH", "V4_PRO", "V41_FLASH", "CSAConfig"]
           + _c.__all__ + _i.__all__ + _a.__all__ + _q.__all__ + _g.__all__)
