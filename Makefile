# Everything runs from a venv in .venv, made on first use.  `make demo` and
# `make test` do all set-up on a fresh machine.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# The CPU build of torch lies on disk on the project's machines; say where, if it exists.
PIP_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
export OMP_NUM_THREADS ?= 2

.PHONY: all venv build demo test bench asan clean

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

bench: build
	$(VPY) benchmarks/run.py

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

clean:
	rm -rf build deepseek_csa/*.so *.egg-info
