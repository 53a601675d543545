"""Installing like a user: the sdist built from this checkout (``python -m build``, isolated build
environment) installs with plain ``pip install`` into a fresh virtual environment, building the
kernels there, and the installed package runs a fused call and a Llama generation from outside the
checkout, its libraries found where pip put them."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ms_rope_attention.cpu_runtime import usable_isas

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration  # make test-all only (docs/testing.md)

CALL = """
import numpy as np, mindspore as ms
import ms_rope_attention as mra
from ms_rope_attention.cpu_kernel import kernel_isa
from ms_rope_attention.cpu_runtime import select_library
from ms_rope_attention import linear
ms.set_device("CPU")
attn = mra.RotaryFlashAttention(head_num=4, head_dim=16, input_layout="BSND")
q = ms.Tensor(np.random.default_rng(0).standard_normal((1, 9, 4, 16)).astype(np.float32))
out = attn(q, q, q)
assert out.shape == (1, 9, 4, 16) and np.isfinite(out.asnumpy()).all(), out
assert attn.backend == "fused:CPU", attn.backend
x, w = np.ones((3, 8), np.float32), np.ones((5, 8), np.float32)
assert (linear.multiply(x, w) == 8).all()
print("fused", attn.backend, kernel_isa(), mra.__file__, select_library()[1], select_library(linear.STEM)[1])
"""


def _run(args, cwd, env=None):
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return done.stdout


@pytest.mark.starts_first
def test_sdist_installs_into_a_fresh_environment_and_runs(tmp_path):
    _run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path / "dist"), str(ROOT)], ROOT)
    (sdist,) = (tmp_path / "dist").glob("ms_rope_attention-*.tar.gz")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    # Nothing of this checkout or of the test environment leaks in.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "RFA_"))}
    # No copy into pip's cache: the environment alone is ~1.5 GB, and CI's disk is not always large.
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-cache-dir", str(sdist)], tmp_path, env)
    site = str(venv / "lib")
    # The best build for this CPU, then each build it can run: every ISA shipped is checked.
    usable = usable_isas()
    for forced in [None, *usable]:
        out = _run([str(python), "-c", CALL], tmp_path, env if forced is None else dict(env, RFA_CPU_ISA=forced))
        fused, backend, isa, package, kernel, gemm = out.split()[-6:]
        assert backend == "fused:CPU" and isa == (forced or usable[0]), out
        assert all(path.startswith(site) for path in (package, kernel, gemm)), out
    out = _run([str(python), "-m", "models.llama.generate", "--model", "tiny", "--ids", "1,15,27",
                "--max-new-tokens", "3"], tmp_path, env)
    assert "backend fused:CPU" in out, out
    shutil.rmtree(venv)  # passed: free its disk for the rest of the suite (a failure keeps it to look at)
