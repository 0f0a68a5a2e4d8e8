"""Build of deepseek_csa._core: every C file under csrc/ in one extension.

Environment knobs (all optional):
  CSA_NATIVE=1    add -march=native (default: portable build, AVX2/AVX-512 picked at run time)
  CSA_SANITIZE=1  build with AddressSanitizer + UndefinedBehaviorSanitizer (make asan)
  CSA_DEBUG=1     -O0 -g
  CSA_OPENMP=0    build the serial module even if the compiler has OpenMP
  CSA_TORCH_NATIVE=0  do not build deepseek_csa.torch._native (see below)

OpenMP is probed, not assumed: before building, a tiny OpenMP program is compiled and
linked with the compiler setuptools will use (with -fopenmp; then, for Apple's clang
with Homebrew's libomp, -Xpreprocessor -fopenmp -lomp).  When none works, the same
sources are built as a serial module (every `#pragma omp` is then ignored and the
omp_* calls are guarded by _OPENMP; `omp simd` still applies through -fopenmp-simd
where the compiler has it, so the bits match the OpenMP build) and the build says so; the module says so again,
once, when it is imported (deepseek_csa.build_info()["openmp"] is False).

deepseek_csa.torch._native (csrc/torch/native.cpp), C++ kernels for some of the torch
operators, is built only where torch is importable at build time (the package's own
build never needs torch): it compiles against torch's C++ headers, so it is tied to
that torch build, whose version is written beside it (_native.torch-version) for
deepseek_csa/torch/ops.py to check before loading it.  It is optional: when it is
absent, fails to build or does not match the torch at run time, the operators keep
their Python kernels and `import deepseek_csa.torch` says so once.
"""
import glob
import os
import shutil
import sys
import tempfile
import textwrap

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# -O3 vectorizes; -ffp-contract=fast fuses a*b+c into FMAs (ISO C modes turn that
# off); -fno-math-errno lets sqrtf inline.  Never -ffast-math: the -inf
# masks and NaN propagation rely on IEEE semantics.
cflags = ["-std=gnu11", "-ffp-contract=fast", "-O3", "-fno-math-errno", "-fno-trapping-math",
          "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-function"]
ldflags = []
sanitize = []     # also given to the C++ extension
if os.environ.get("CSA_NATIVE") == "1":
    cflags.append("-march=native")
if os.environ.get("CSA_DEBUG") == "1":
    cflags += ["-O0", "-g"]
if os.environ.get("CSA_SANITIZE") == "1":
    # float-cast-overflow is UB that -fsanitize=undefined leaves out in GCC (a float
    # index or size cast to an integer); float division by zero is IEEE, not checked.
    sanitize = ["-fsanitize=address,undefined,float-cast-overflow", "-fno-omit-frame-pointer",
                "-fno-sanitize-recover=all", "-g"]
    cflags += sanitize
    ldflags += sanitize

# (compile flags, link flags) to try, in order.
OPENMP_CANDIDATES = [
    (["-fopenmp"], ["-fopenmp"]),
    (["-Xpreprocessor", "-fopenmp"], ["-lomp"]),  # Apple clang + libomp (brew install libomp)
]

OPENMP_PROBE = textwrap.dedent("""\
    #include <omp.h>
    #include <stdio.h>
    int main(void)
    {
        int n = 0;
    #pragma omp parallel reduction(+ : n)
        n += 1;
        printf("%d %d\\n", n, omp_get_max_threads());
        return n < 1;
    }
    """)


def _try_compile(compiler, source, cargs, largs, tmp, name):
    """Compile and link `source` in tmp; True when both succeed (output silenced)."""
    src = os.path.join(tmp, name + ".c")
    with open(src, "w") as f:
        f.write(source)
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        objs = compiler.compile([src], output_dir=tmp, extra_postargs=cargs)
        compiler.link_executable(objs, name, output_dir=tmp, extra_postargs=largs)
        return True
    except Exception:
        return False
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        os.close(devnull)


def probe_openmp(compiler):
    """(compile flags, link flags) that build an OpenMP program with `compiler`, or None."""
    if os.environ.get("CSA_OPENMP") == "0":
        return None
    tmp = tempfile.mkdtemp(prefix="csa_omp_probe_")
    try:
        for i, (cargs, largs) in enumerate(OPENMP_CANDIDATES):
            if _try_compile(compiler, OPENMP_PROBE, cargs, largs, tmp, "probe%d" % i):
                return cargs, largs
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def accepts_flag(compiler, flag):
    tmp = tempfile.mkdtemp(prefix="csa_flag_probe_")
    try:
        return _try_compile(compiler, "int main(void) { return 0; }\n", ["-Werror", flag], [],
                            tmp, "flag")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class BuildExt(build_ext):
    def build_extensions(self):
        omp = probe_openmp(self.compiler)
        for ext in self.extensions:
            if omp is not None:
                ext.extra_compile_args = omp[0] + ext.extra_compile_args
                ext.extra_link_args = omp[1] + ext.extra_link_args
            else:
                # `omp simd` (reductions vectorized in a fixed lane order) needs no
                # runtime: keep it, so the serial module computes the OpenMP build's
                # bits; the thread-count variables only feed the ignored pragmas
                quiet = ["-Wno-unused-variable", "-Wno-unused-but-set-variable"]
                if accepts_flag(self.compiler, "-fopenmp-simd"):
                    quiet.insert(0, "-fopenmp-simd")
                if accepts_flag(self.compiler, "-Wno-source-uses-openmp"):  # clang
                    quiet.append("-Wno-source-uses-openmp")
                ext.extra_compile_args = ext.extra_compile_args + quiet
        if omp is None:
            print("\n*** deepseek_csa: this C compiler cannot build OpenMP code "
                  "(tried -fopenmp and -Xpreprocessor -fopenmp -lomp).\n"
                  "*** Building the SERIAL module: every kernel runs on one thread.\n"
                  "*** For threads: use GCC, or on macOS `brew install libomp` "
                  "(or set CC to an OpenMP-capable compiler) and reinstall.\n"
                  if os.environ.get("CSA_OPENMP") != "0" else
                  "\n*** deepseek_csa: CSA_OPENMP=0, building the serial module.\n",
                  file=sys.stderr)
        super().build_extensions()

    def build_extension(self, ext):
        super().build_extension(ext)
        if ext.name == NATIVE_NAME:   # the torch it was built against, read before loading
            with open(self._native_version_file(), "w") as f:
                f.write(TORCH_VERSION + "\n")

    def _native_version_file(self):   # in build_lib, beside the built module
        return os.path.join(self.build_lib, *NATIVE_NAME.split(".")[:-1],
                            "_native.torch-version")

    def copy_extensions_to_source(self):   # --inplace: the version file goes with the .so
        super().copy_extensions_to_source()
        if any(e.name == NATIVE_NAME for e in self.extensions) and \
                os.path.exists(self._native_version_file()):
            package_dir = self.get_finalized_command("build_py").get_package_dir(
                "deepseek_csa.torch")
            shutil.copyfile(self._native_version_file(),
                            os.path.join(package_dir, "_native.torch-version"))


NATIVE_NAME = "deepseek_csa.torch._native"
TORCH_VERSION = None


def native_extension():
    """The optional C++ extension over torch's headers, or None where torch is absent."""
    global TORCH_VERSION
    if os.environ.get("CSA_TORCH_NATIVE") == "0":
        return None
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception:   # no torch at build time: the operators keep Python kernels
        print("*** deepseek_csa: torch is not importable here; deepseek_csa.torch._native "
              "(C++ operator kernels) is not built.", file=sys.stderr)
        return None
    TORCH_VERSION = torch.__version__
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    lib_dirs = cpp_extension.library_paths()
    return Extension(
        NATIVE_NAME,
        sources=["csrc/torch/native.cpp"],
        include_dirs=["csrc"] + cpp_extension.include_paths(),
        library_dirs=lib_dirs,
        libraries=["c10", "torch", "torch_cpu", "torch_python"],
        language="c++",
        define_macros=[("CSA_TORCH_VERSION", '"%s"' % TORCH_VERSION),
                       ("_GLIBCXX_USE_CXX11_ABI", str(abi)),
                       ("TORCH_API_INCLUDE_EXTENSION_H", None)],
        extra_compile_args=["-std=c++20", "-O2", "-fvisibility=hidden"] + sanitize,
        extra_link_args=["-Wl,-rpath," + d for d in lib_dirs] + sanitize,
        depends=sorted(glob.glob("csrc/*.h")),
        optional=True,   # a failed build leaves the Python kernels, with a warning
    )


sources = sorted(glob.glob("csrc/*.c")) + sorted(glob.glob("csrc/glue/*.c"))

core_extension = Extension(
    "deepseek_csa._core",
    sources=sources,
    include_dirs=[numpy.get_include(), "csrc"],
    extra_compile_args=cflags,
    extra_link_args=ldflags,
    depends=sorted(glob.glob("csrc/*.h") + glob.glob("csrc/glue/*.h")),
)
native = native_extension()

setup(
    ext_modules=[core_extension] + ([native] if native is not None else []),
    cmdclass={"build_ext": BuildExt},
)
