"""The oldest Python that pyproject.toml's requires-python admits, tested for real: in a virtual environment
of that Python (make oldest-python: .venv-py310, this project installed editable with its kernels, as a
user would), every module of the package compiles, the package and models.llama import and load their
kernels, and the tiny model trains one step through the training CLI and resumes from it. Each run hashes
its data file, which once used hashlib.file_digest (3.11+) and failed every run below 3.11."""
import json
import os
import re
import subprocess
import tomllib

import pytest
from conftest import ROOT, thirdparty_python

pytestmark = pytest.mark.integration  # make test-all only (docs/testing.md)

def oldest_python() -> str:
    return thirdparty_python("python3.10")


def run(python, args, cwd, timeout=900):
    done = subprocess.run([python, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


def test_the_environment_is_the_declared_floor(tmp_path):
    """What runs here is the oldest Python pyproject.toml declares, so the two cannot drift apart."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        declared = tomllib.load(handle)["project"]["requires-python"]
    floor = re.fullmatch(r">=\s*(\d+)\.(\d+)", declared.strip())
    assert floor, f"requires-python {declared!r} is not of the form >=X.Y"
    version = run(oldest_python(), ["-c", "import sys; print(*sys.version_info[:2])"], tmp_path).split()
    assert tuple(map(int, version)) == tuple(map(int, floor.groups())), (declared, version)


IMPORTS = r"""
import pathlib, sys
import ms_rope_attention
from ms_rope_attention import cpu_kernel
import models.llama, models.llama.train, models.llama.generate, models.llama.engine
root = pathlib.Path(ms_rope_attention.__file__).parent.parent
assert root == pathlib.Path(sys.argv[1]), (root, sys.argv[1])  # the checkout, installed editable
for package in ("ms_rope_attention", "models"):
    for path in sorted((root / package).rglob("*.py")):
        compile(path.read_text(), str(path), "exec")  # this Python's parser, every module, imported or not
assert cpu_kernel.unavailable() is None, cpu_kernel.unavailable()
print("isa", cpu_kernel.kernel_isa(), "python", *sys.version_info[:2])
"""


def test_package_imports_and_loads_its_kernels(tmp_path):
    output = run(oldest_python(), ["-c", IMPORTS, ROOT], tmp_path)
    assert "isa " in output, output[-2000:]


def test_training_step_and_resume_through_the_cli(corpus, tmp_path):
    python, out = oldest_python(), tmp_path / "run"
    common = ["-m", "models.llama.train", "--model", "tiny", "--data", str(corpus), "--out", str(out),
              "--seq-len", "64", "--batch-size", "2", "--warmup", "0", "--backend", "fused"]
    output = run(python, common + ["--steps", "1"], tmp_path)
    assert "final loss " in output and (out / "latest").read_text() == "step-1", output[-2000:]
    output = run(python, common + ["--steps", "2", "--resume"], tmp_path)
    assert (out / "latest").read_text() == "step-2", output[-2000:]
    # The resume read the first run's trainer.json and accepted the data file's hash as the same file's.
    assert json.loads((out / "step-2" / "trainer.json").read_text())["step"] == 2
