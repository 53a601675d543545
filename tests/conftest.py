"""Shared fixtures: CPU device, execution modes, random inputs, and dtype tolerances."""
import contextlib
import gc
import os
import sys
import threading
import time

import numpy as np
import pytest
from _pytest.runner import runtestprotocol  # pytest's own protocol, for the skipped cases of a --forked run
from _pytest.skipping import evaluate_skip_marks

sys.path.insert(0, os.path.dirname(__file__))

import ms_rope_attention  # noqa: E402,F401  before MindSpore, as users import it (docs/threads.md)
import mindspore as ms  # noqa: E402
from suite_profile import pytest_configure  # noqa: E402,F401  RFA_SUITE_PROFILE=DIR: where the time goes

ms.set_device("CPU")

# tests/thirdparty/ runs inside MindFormers' and mindnlp's own environments (tests/test_fuse_thirdparty.py).
collect_ignore = ["thirdparty"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name -> (its environment, the stamp its make target leaves there, the make target); the oldest declared
# Python is one too, and transformers (with PyTorch) is the benchmarks' peers extra in .venv itself, run in
# a process of its own (its OpenMP runtime stays out of the test's).
THIRDPARTY_VENVS = {"mindformers": (os.path.join(ROOT, ".venv-mindformers"), ".installed", "make thirdparty"),
                    "mindnlp": (os.path.join(ROOT, ".venv-mindnlp"), ".installed", "make thirdparty"),
                    "llama.cpp": (os.path.join(ROOT, ".venv-llamacpp"), ".installed", "make llama-cpp"),
                    "aiperf": (os.path.join(ROOT, ".venv-aiperf"), ".installed", "make aiperf"),
                    "python3.10": (os.path.join(ROOT, ".venv-py310"), ".installed", "make oldest-python"),
                    "transformers": (os.path.join(ROOT, ".venv"), ".peers", "make thirdparty")}


def thirdparty_python(library: str) -> str:
    """The Python of a third-party library's environment; a skip when it is not installed, a
    failure under RFA_REQUIRE_THIRDPARTY=1 (CI, which installs them: a skip there guards nothing)."""
    venv, stamp, target = THIRDPARTY_VENVS[library]
    if not os.path.exists(os.path.join(venv, stamp)):
        message = f"{library}'s environment {venv} is not installed ({target})"
        if os.environ.get("RFA_REQUIRE_THIRDPARTY") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return os.path.join(venv, "bin", "python")

# Tolerances (max abs error vs the float64 reference, unit-scale inputs). float32: 1e-5. float16 /
# bfloat16: the reference runs on the same dtype-rounded inputs, so the budget is the output's own
# rounding plus float32 accumulation: 2 ulp at the output's magnitude.
EPS = {"float32": 0.0, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def tolerance(dtype: str, reference: np.ndarray) -> float:
    magnitude = float(np.abs(reference).max()) if reference.size else 0.0
    return 1e-5 + 2 * EPS[dtype] * max(magnitude, 1.0)


MS_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded to ``dtype`` and back to float64 (what the kernel actually receives)."""
    return ms.Tensor(x.astype(np.float32)).astype(MS_DTYPES[dtype]).astype(ms.float32).asnumpy().astype(np.float64)


def to_tensor(x: np.ndarray, dtype: str) -> ms.Tensor:
    return ms.Tensor(x.astype(np.float32)).astype(MS_DTYPES[dtype])


def to_numpy(t: ms.Tensor) -> np.ndarray:
    return t.astype(ms.float32).asnumpy().astype(np.float64)


WORKER_MODE = ms.get_context("mode")


@pytest.fixture(autouse=True)
def _execution_mode_restored():
    """Every test starts and ends in the worker's execution mode: a test, or a module fixture set up for
    it (the training CLI sets GRAPH_MODE), that switches to GRAPH_MODE without switching back would leave
    the tests after it in that worker (xdist's order varies from run to run) compiling graphs they were
    not written for (a module-level function MindSpore cannot import by name fails to compile)."""
    ms.set_context(mode=WORKER_MODE)
    yield
    if ms.get_context("mode") != WORKER_MODE:
        ms.set_context(mode=WORKER_MODE)


@pytest.fixture(autouse=True, scope="module")
def _live_objects_frozen():
    """What lives when a module starts (MindSpore's, numpy's and the suite's modules and their objects, the
    session's fixtures) moves to the garbage collector's permanent generation, after the last module's garbage
    is collected: MindSpore runs a full collection before every graph compile, which otherwise walks all of
    it again each time (0.16 s a compile in a fresh worker, more in a long one)."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def graph():
    """The test in GRAPH_MODE."""
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=previous)


@pytest.fixture(params=["pynative", "graph"])
def mode(request):
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE if request.param == "pynative" else ms.GRAPH_MODE)
    yield request.param
    ms.set_context(mode=previous)


@pytest.fixture
def bf16_engines(monkeypatch):
    """``for engine in bf16_engines(compute_dtype): ...`` runs the body once per engine of bfloat16
    arithmetic (oneDNN's bfloat16 units, and the same products on the float32 FMAs: RFA_BF16_GEMM,
    csrc/rfa_cpu_linear.cc says why two), so every CPU tests both; once, as the process would choose,
    for any other compute dtype."""
    def engines(compute_dtype: str = "bfloat16"):
        for engine in ("onednn", "fma") if compute_dtype == "bfloat16" else ("auto",):
            monkeypatch.setenv("RFA_BF16_GEMM", engine)
            yield engine
        monkeypatch.delenv("RFA_BF16_GEMM")
    return engines


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def corpus(tmp_path):
    """A small text file, a document per line, for the training CLI."""
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat and the dog ran to the park while birds sang".split()
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(words, rng.integers(3, 10))) for _ in range(300)) + "\n")
    return path


def pytest_collection_modifyitems(items):
    """The tests marked starts_first go to the workers first, the rest in their order: started last, one
    of them would run alone at the end of the suite while the other workers idle."""
    items.sort(key=lambda item: item.get_closest_marker("starts_first") is None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Under ``--forked`` (make sanitize's one process per case), a case that its skipif marks skip is
    reported from this process instead of a fork of it: a worker under AddressSanitizer takes about 0.3 s
    to fork, and on a CPU without bfloat16 instructions most of the bfloat16 modules' cases skip."""
    if not (item.config.getoption("forked", default=False) and evaluate_skip_marks(item)):
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    runtestprotocol(item, nextitem=nextitem)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="run the long form of the property tests (thousands of random cases)")


@pytest.fixture
def long_run(request):
    return request.config.getoption("--long")


@contextlib.contextmanager
def running_in_thread(server, ready=lambda: True, timeout: float = 30.0):
    """A uvicorn ``server`` serving in a thread of this process until the block ends, entered once it
    listens and ``ready()`` holds."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not (server.started and ready()):
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(30)
