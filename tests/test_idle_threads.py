"""The CPU kernels' idle threads sleep between calls (docs/threads.md).

OpenMP: importing the package before MindSpore sets OMP_WAIT_POLICY=PASSIVE for libgomp, which reads
it once, when MindSpore loads it; read back from libgomp itself (OMP_DISPLAY_ENV=VERBOSE prints its
spin count as it loads). OpenBLAS: the package sets OPENBLAS_THREAD_TIMEOUT=4 before linear.py loads
the library; seen as the CPU time the process burns while it sleeps right after a threaded SGEMM."""
import functools
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.xdist_group("idle_threads")  # one worker starts each process once

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
print("burned", *burned)
"""

# The fresh processes: what each imports first and the environment it adds (OMP_WAIT_POLICY and
# OPENBLAS_THREAD_TIMEOUT, the variables under test, are unset otherwise); the first two then also
# measure the CPU burned in a sleep after an SGEMM: OpenBLAS's threads (pthreads) are not libgomp's.
FRESH_PROCESSES = {
    "import ms_rope_attention": dict(first="import ms_rope_attention", env={}, sgemm=True),
    "import models.llama.generate": dict(first="import models.llama.generate", env={"OPENBLAS_THREAD_TIMEOUT": "28"},
                                         sgemm=True),
    "a policy set": dict(first="import ms_rope_attention", env={"OMP_WAIT_POLICY": "ACTIVE"}, sgemm=False),
    "mindspore first": dict(first="import mindspore, ms_rope_attention", env={}, sgemm=False),
}


@functools.cache
def fresh_process(name: str) -> dict:
    """What the fresh process ``name`` of FRESH_PROCESSES read back: libgomp's GOMP_SPINCOUNT (``spin``), os.environ's
    OMP_WAIT_POLICY after the imports (``policy``) and, where it measured them, the seconds of CPU it used in
    each of 3 sleeps of 0.3 s right after an SGEMM (``burned``)."""
    process = FRESH_PROCESSES[name]
    code = process["first"] + "; import os; print('policy', os.environ.get('OMP_WAIT_POLICY'))\n"
    code += IDLE_AFTER_SGEMM if process["sgemm"] else ""
    child_env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OPENBLAS_THREAD_TIMEOUT")}
    child_env.update(process["env"], OMP_DISPLAY_ENV="VERBOSE", OPENBLAS_NUM_THREADS="2", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env, cwd=ROOT,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    counts = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", run.stderr + run.stdout)
    assert counts, "libgomp printed no GOMP_SPINCOUNT: " + run.stderr[-2000:]
    burned = re.search(r"^burned (.+)$", run.stdout, flags=re.M)
    return {"spin": counts[0], "policy": re.search(r"^policy (\S+)$", run.stdout, flags=re.M).group(1),
            "burned": burned and [float(seconds) for seconds in burned.group(1).split()]}


def spin_and_policy(name: str) -> tuple[str, str]:
    return fresh_process(name)["spin"], fresh_process(name)["policy"]


@pytest.mark.parametrize("code", ["import ms_rope_attention", "import models.llama.generate"])
def test_imported_first_the_threads_sleep(code):
    assert spin_and_policy(code) == ("0", "PASSIVE")


def test_a_policy_already_set_is_kept():
    assert spin_and_policy("a policy set") == ("30000000000", "ACTIVE")


def test_imported_after_mindspore_libgomp_keeps_its_default():
    # The limitation docs/threads.md states: libgomp read its environment when MindSpore loaded it.
    assert spin_and_policy("mindspore first") == ("300000", "PASSIVE")


def test_openblas_threads_sleep_after_a_gemm():
    # OpenBLAS's own default (a timeout of 2^28 clock ticks) spins a worker into the sleep: 0.128 s of
    # CPU measured alone on 2 cores (0.0001 s with the package's 2^4). Bounds loose for a busy machine, each
    # judged on the side its noise cannot push it to: other processes add CPU (the least of 3 sleeps must be
    # under) and take the spinning worker's core away (the least was 0.016 s at a load of 7: the most must be over).
    assert min(fresh_process("import ms_rope_attention")["burned"]) < 0.01
    assert max(fresh_process("import models.llama.generate")["burned"]) > 0.02
