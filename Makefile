# Two commands do all set-up on a fresh machine: `make test` and `make bench`.
# Both create/refresh the local virtual environment .venv idempotently (re-run only when
# requirements or the kernel sources change).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
KERNEL_SOURCES := $(wildcard ms_rope_attention/csrc/*) setup.py

.PHONY: test bench venv clean

venv: $(STAMP)

$(STAMP): requirements.txt $(KERNEL_SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/attention.py

clean:
	rm -rf build $(VENV) ms_rope_attention/_rfa_cpu_*.so *.egg-info
