"""fuse() on the real third-party models: tests/thirdparty/test_<library>.py run by pytest inside
that library's own virtual environment (MindFormers 2.0.0 in GRAPH_MODE and PyNative; mindnlp 0.5.1's
Hugging Face Llama, Mistral and Qwen2 in PyNative), with this project installed into it."""
import os
import subprocess

import pytest
from conftest import ROOT, thirdparty_python

pytestmark = pytest.mark.integration  # make test-all only (docs/testing.md)


@pytest.mark.parametrize("library", ["mindformers", "mindnlp"])
def test_fuse_on_the_librarys_models(library):
    python = thirdparty_python(library)
    here = os.path.join(ROOT, "tests", "thirdparty")
    done = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", here,
                           "--confcutdir", here, os.path.join(here, f"test_{library}.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert " passed" in output and "skipped" not in output, output[-2000:]
