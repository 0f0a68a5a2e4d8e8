"""Build of deepseek_csa._core: every C file under csrc/ in one extension.

Environment knobs (all optional):
  CSA_NATIVE=1    add -march=native (default: portable build, AVX2/AVX-512 picked at run time)
  CSA_SANITIZE=1  build with AddressSanitizer + UndefinedBehaviorSanitizer (make asan)
  CSA_DEBUG=1     -O0 -g
"""
import glob
import os

import numpy
from setuptools import Extension, setup

# -O3 vectorizes; -ffp-contract=fast fuses a*b+c into FMAs (ISO C modes turn that
# off); -fno-math-errno lets sqrtf inline.  Never -ffast-math: the -inf
# masks and NaN propagation rely on IEEE semantics.
cflags = ["-std=gnu11", "-ffp-contract=fast", "-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
          "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-function"]
ldflags = ["-fopenmp"]
if os.environ.get("CSA_NATIVE") == "1":
    cflags.append("-march=native")
if os.environ.get("CSA_DEBUG") == "1":
    cflags += ["-O0", "-g"]
if os.environ.get("CSA_SANITIZE") == "1":
    # float-cast-overflow is UB that -fsanitize=undefined leaves out in GCC (a float
    # index or size cast to an integer); float division by zero is IEEE, not checked.
    san = ["-fsanitize=address,undefined,float-cast-overflow", "-fno-omit-frame-pointer",
           "-fno-sanitize-recover=all"]
    cflags += san + ["-g"]
    ldflags += san

sources = sorted(glob.glob("csrc/*.c")) + sorted(glob.glob("csrc/glue/*.c"))

setup(
    ext_modules=[
        Extension(
            "deepseek_csa._core",
            sources=sources,
            include_dirs=[numpy.get_include(), "csrc"],
            extra_compile_args=cflags,
            extra_link_args=ldflags,
            depends=sorted(glob.glob("csrc/*.h") + glob.glob("csrc/glue/*.h")),
        )
    ],
)
