"""The kernels' OpenMP threads sleep between calls (docs/threads.md): importing the package before
MindSpore sets OMP_WAIT_POLICY=PASSIVE for libgomp, which reads it once, when MindSpore loads it.
Read back from libgomp itself (OMP_DISPLAY_ENV=VERBOSE prints its spin count as it loads)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spin_count(code: str, **env) -> tuple[str, str]:
    """(libgomp's GOMP_SPINCOUNT, os.environ's OMP_WAIT_POLICY after ``code``) in a fresh process."""
    child_env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    child_env.update(env, OMP_DISPLAY_ENV="VERBOSE", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", code + "; import os; print('policy', os.environ.get('OMP_WAIT_POLICY'))"],
                         capture_output=True, text=True, env=child_env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
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
