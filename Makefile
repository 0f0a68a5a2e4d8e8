# Everything runs from a venv in .venv, made on first use.  `make demo` and
# `make test` do all set-up on a fresh machine.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# The CPU build of torch lies on disk on the project's machines; say where, if it exists.
PIP_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
export OMP_NUM_THREADS ?= 2

.PHONY: all venv build demo test bench asan clean test-noomp test-c test-aarch64 mutants test-hf-versions peers test-clang test-aarch64-clang test-runner-extra test-dist

all: build

$(VENV)/.deps: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(PIP_LINKS) "setuptools>=64" wheel "numpy>=2" \
	    pytest hypothesis threadpoolctl ml_dtypes tqdm matplotlib nbclient nbformat ipykernel "torch==2.13.0" "transformers==5.23.0" safetensors
	touch $@

venv: $(VENV)/.deps

# In-place build: the package runs from this checkout.
build: venv
	$(VPY) setup.py -q build_ext --inplace

demo: build
	$(VPY) -m deepseek_csa.demo

test: build
	$(VPY) -m pytest -q tests

# Planted bugs (tests/mutants/m_*.py), each run against the tests that claim to cover
# it; prints `mutants: K/N killed` and fails when one survives.  MUTANTS_ARGS="-k attn".
mutants: build
	$(VPY) tests/mutants/run.py $(MUTANTS_ARGS)

bench: build
	$(VPY) benchmarks/run.py

# llama.cpp as a peer (issue 27; not part of `make test` or CI): fetches the pinned
# llama-cpp-python sdist with pip, builds only its vendored ggml (CPU, -DGGML_NATIVE=ON)
# under build/peers/ once, and compiles benchmarks/llamacpp_ops.c against it; then
# `$(VPY) benchmarks/bench_llamacpp.py [--quick]`.  PEERS_JOBS=2 by default.
peers:
	PY=$(VPY) sh benchmarks/build_llamacpp.sh

# The transformers bridge tests under every release in
# deepseek_csa.transformers.SUPPORTED_VERSIONS (`make test` runs them on the venv's
# pinned one): each other release is pip-installed once into build/hf-versions/<v> and
# laid over the venv on PYTHONPATH (see tests/hf_versions.py).  About 40 s CPU.
test-hf-versions: build
	$(VPY) tests/hf_versions.py

# AddressSanitizer + UndefinedBehaviorSanitizer build, then the suite under it
# (ASAN_TESTS=... for a subset).  Python is not instrumented, so the sanitizer
# runtimes are preloaded; leak detection is off (the interpreter keeps objects alive
# at exit) and huge allocations return NULL (-> MemoryError) instead of aborting.
# The normal build is restored whether or not the run passed.
ASAN_TESTS ?= tests
asan: venv
	rm -rf build/asan && CSA_SANITIZE=1 $(VPY) setup.py -q build_ext --inplace --build-temp build/asan --force
	status=0; \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:check_initialization_order=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	    $(VPY) -m pytest -q $(ASAN_TESTS) -p no:cacheprovider || status=$$?; \
	$(VPY) setup.py -q build_ext --inplace --force; \
	exit $$status

# `pip install .` with a C compiler that rejects -fopenmp (Apple's clang without
# libomp, simulated by tests/c/cc-without-openmp) into a temp dir: the build must
# fall back to a serial module that warns once and computes the OpenMP build's bits.
test-noomp: build
	CSA_TEST_NOOMP=1 $(VPY) -m pytest -q tests/test_build.py -p no:cacheprovider

# The C test driver (tests/c/driver.c): every tuned kernel against its scalar `_ref`
# at every ISA level built and supported here, NaN / inf inputs, 1 vs 2 threads
# bitwise.  Plain C, no Python, no venv: the kernel sources (not the glue) with the
# extension's flags.  The serial (no-OpenMP) build: make test-c TESTC_DIR=build/test-c-serial
# TESTC_OMP="-fopenmp-simd -Wno-unused-variable"
TESTC_CFLAGS := -std=gnu11 -ffp-contract=fast -O3 -fno-math-errno -fno-trapping-math \
	-Wall -Wno-unknown-pragmas -Wno-unused-function -Icsrc
TESTC_OMP ?= -fopenmp
KERNEL_SRCS := $(sort $(wildcard csrc/*.c))
KERNEL_HDRS := $(wildcard csrc/*.h)
TESTC_DIR := build/test-c

$(TESTC_DIR)/%.o: csrc/%.c $(KERNEL_HDRS)
	@mkdir -p $(@D)
	$(CC) $(TESTC_CFLAGS) $(TESTC_OMP) -c $< -o $@
$(TESTC_DIR)/driver.o: tests/c/driver.c $(KERNEL_HDRS)
	@mkdir -p $(@D)
	$(CC) $(TESTC_CFLAGS) $(TESTC_OMP) -c $< -o $@
$(TESTC_DIR)/driver: $(patsubst csrc/%.c,$(TESTC_DIR)/%.o,$(KERNEL_SRCS)) $(TESTC_DIR)/driver.o
	$(CC) $(TESTC_OMP) $^ -o $@ -lm

test-c: $(TESTC_DIR)/driver
	OMP_NUM_THREADS=2 $(TESTC_DIR)/driver

# The same driver cross-compiled for aarch64 (GCC vector extensions -> NEON; the x86
# intrinsics stay behind their guards) and run under qemu user emulation, so the ARM
# path is tested, not just compiled.  Installs gcc-aarch64-linux-gnu and
# qemu-user-static (Debian/Ubuntu, apt-get, as root or via sudo) when missing.
# Minutes, not seconds: not part of `make test`.
A64_CC ?= aarch64-linux-gnu-gcc
A64_SYSROOT ?= /usr/aarch64-linux-gnu
test-aarch64:
	@if ! command -v $(A64_CC) >/dev/null || ! { command -v qemu-aarch64 || command -v qemu-aarch64-static; } >/dev/null; then \
	    echo "installing gcc-aarch64-linux-gnu qemu-user-static"; \
	    SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user-static; \
	fi
	$(MAKE) --no-print-directory CC=$(A64_CC) TESTC_DIR=build/test-aarch64 build/test-aarch64/driver
	file build/test-aarch64/driver 2>/dev/null || true
	OMP_NUM_THREADS=2 QEMU_LD_PREFIX=$(A64_SYSROOT) \
	    $$(command -v qemu-aarch64 || command -v qemu-aarch64-static) build/test-aarch64/driver

# Distributions: the sdist (every C source and header in it), a wheel built from the
# sdist alone, installed into a fresh venv outside the checkout, importing, running a
# kernel, the demo and the notebook's first cells (tests/test_dist.py).  About 2 min.
test-dist: build
	CSA_TEST_DIST=1 $(VPY) -m pytest -q tests/test_dist.py -p no:cacheprovider

# `pip install '.[runner]'` into a fresh venv (torch 2.13.0 from the machine's wheel or
# PyPI, the package built from source), then the runner on a tiny checkpoint with a
# tokenizer.json and text prompts in that venv (tests/test_runner_extra.py).  A few
# minutes and about 1 GB in a temp dir: not in `make test`.
test-runner-extra: build
	CSA_TEST_RUNNER_EXTRA=1 $(VPY) -m pytest -q tests/test_runner_extra.py -p no:cacheprovider

# clang builds (issue 29), as Apple's compiler would do them: the C driver built by clang
# with OpenMP (x86: the base level only, see CSA_X86_VARIANTS in csrc/csa.h) and without
# (every level), then `pip install .` with CC=clang with and without OpenMP into temp
# dirs: every kernel bitwise equal to the gcc build at each level, and the fast kernel
# tests against the clang module (tests/test_clang.py).  Installs clang and libomp-dev
# (apt-get) when missing.  About 4 minutes on 2 cores.
CLANG ?= clang
APT_INSTALL = SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq
TESTC_SERIAL := -fopenmp-simd -Wno-unused-variable -Wno-unknown-warning-option -Wno-source-uses-openmp
test-clang: build
	@if ! command -v $(CLANG) >/dev/null || ! echo '#include <omp.h>' | $(CLANG) -fopenmp -E -x c - >/dev/null 2>&1; then \
	    echo "installing clang libomp-dev"; $(APT_INSTALL) clang libomp-dev; fi
	$(MAKE) --no-print-directory test-c CC=$(CLANG) TESTC_DIR=build/test-c-clang
	$(MAKE) --no-print-directory test-c CC=$(CLANG) TESTC_DIR=build/test-c-clang-serial TESTC_OMP="$(TESTC_SERIAL)"
	CSA_TEST_CLANG=1 $(VPY) -m pytest -q tests/test_clang.py -p no:cacheprovider

# The C driver cross-built by clang for aarch64 (the nearest thing to Apple Silicon
# here: clang, NEON through the vector extensions, no OpenMP runtime for the target, so
# the serial build), linked with Debian's aarch64 toolchain and run under qemu.
# Installs clang, gcc-aarch64-linux-gnu and qemu-user-static when missing.  About 30 s.
test-aarch64-clang:
	@if ! command -v $(CLANG) >/dev/null || ! command -v $(A64_CC) >/dev/null || \
	    ! { command -v qemu-aarch64 || command -v qemu-aarch64-static; } >/dev/null; then \
	    echo "installing clang gcc-aarch64-linux-gnu qemu-user-static"; \
	    $(APT_INSTALL) clang gcc-aarch64-linux-gnu qemu-user-static; fi
	$(MAKE) --no-print-directory CC="$(CLANG) --target=aarch64-linux-gnu" \
	    TESTC_DIR=build/test-aarch64-clang TESTC_OMP="$(TESTC_SERIAL)" build/test-aarch64-clang/driver
	OMP_NUM_THREADS=2 QEMU_LD_PREFIX=$(A64_SYSROOT) \
	    $$(command -v qemu-aarch64 || command -v qemu-aarch64-static) build/test-aarch64-clang/driver

clean:
	rm -rf build deepseek_csa/*.so *.egg-info
