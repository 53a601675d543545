"""The CPU kernels' idle threads sleep between calls (docs/threads.md).

OpenMP: importing the package before MindSpore sets OMP_WAIT_POLICY=PASSIVE for libgomp, which reads
it once, when MindSpore loads it; read back from libgomp itself (OMP_DISPLAY_ENV=VERBOSE prints its
spin count as it loads). OpenBLAS: the package sets OPENBLAS_THREAD_TIMEOUT=4 before linear.py loads
the library; seen as the CPU time the process burns while it sleeps right after a threaded SGEMM."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fresh_python(code: str, unset: str, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter on this checkout, with ``unset`` removed from this process's
    environment (the variable under test) and ``env`` added; asserts it succeeded."""
    child_env = {k: v for k, v in os.environ.items() if k != unset}
    child_env.update(env, PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env, cwd=ROOT,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run


def spin_count(code: str, **env) -> tuple[str, str]:
    """(libgomp's GOMP_SPINCOUNT, os.environ's OMP_WAIT_POLICY after ``code``) in a fresh process."""
    run = fresh_python(code + "; import os; print('policy', os.environ.get('OMP_WAIT_POLICY'))", "OMP_WAIT_POLICY",
                       OMP_DISPLAY_ENV="VERBOSE", **env)
    counts = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", run.stderr + run.stdout)
    assert counts, "libgomp printed no GOMP_SPINCOUNT: " + run.stderr[-2000:]
    return counts[0], run.stdout.split("policy ")[-1].strip()


@pytest.mark.parametrize("code", ["import ms_rope_attention", "import models.llama.generate"])
def test_imported_first_the_threads_sleep(code):
    assert spin_count(code) == ("0", "PASSIVE")


def test_a_policy_already_set_is_kept():
    assert spin_count("import ms_rope_attention", OMP_WAIT_POLICY="ACTIVE") == ("30000000000", "ACTIVE")


def test_imported_after_mindspore_libgomp_keeps_its_default():
    # The limitation docs/threads.md states: libgomp read its environment when MindSpore loaded it.
    count, policy = spin_count("import mindspore, ms_rope_attention")
    assert count == "300000" and policy == "PASSIVE"


IDLE_AFTER_SGEMM = """
import time, numpy as np
import ms_rope_attention
from ms_rope_attention import linear
assert linear.blas_threads() == 2
rng = np.random.default_rng(0)
x, w = rng.standard_normal((512, 1024), dtype=np.float32), rng.standard_normal((1024, 1024), dtype=np.float32)
for _ in range(3):
    linear.multiply(x, w)  # M = 512: OpenBLAS's SGEMM, on its 2 threads
burned = []
for _ in range(3):
    linear.multiply(x, w)
    start = time.process_time()  # every thread of the process
    time.sleep(0.3)
    burned.append(time.process_time() - start)
print("burned", min(burned))
"""


def cpu_burned_while_asleep(**env) -> float:
    """Seconds of CPU the process used in a 0.3 s sleep right after an SGEMM (min of 3)."""
    run = fresh_python(IDLE_AFTER_SGEMM, "OPENBLAS_THREAD_TIMEOUT", OPENBLAS_NUM_THREADS="2", **env)
    return float(run.stdout.split("burned ")[-1])


def test_openblas_threads_sleep_after_a_gemm():
    # OpenBLAS's own default (a timeout of 2^28 clock ticks) spins a worker into the sleep: 0.128 s of
    # CPU measured alone on 2 cores (0.0001 s with the package's 2^4). Bounds loose for a busy machine.
    assert cpu_burned_while_asleep() < 0.01
    assert cpu_burned_while_asleep(OPENBLAS_THREAD_TIMEOUT="28") > 0.02
