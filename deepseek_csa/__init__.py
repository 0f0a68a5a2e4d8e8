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

__all__ = (["apply_rope", "rms_norm", "rope_table", "get_isa", "set_isa", "best_isa",
            "max_threads", "V4_FLASH", "V4_PRO", "V41_FLASH", "CSAConfig"]
           + _c.__all__ + _i.__all__ + _a.__all__ + _q.__all__ + _g.__all__)
