"""Tests of ``fuse`` on third-party models, run by ``tests/test_fuse_thirdparty.py`` inside each
library's own virtual environment (``.venv-mindformers``, ``.venv-mindnlp``), not by the main suite."""
import logging

import mindspore as ms
import pytest

ms.set_device("CPU")


@pytest.fixture
def fallback_warnings(caplog):
    """The ``rotary_fusion_fallback`` messages logged during the test."""
    caplog.set_level(logging.WARNING, logger="ms_rope_attention")
    return lambda: [r.getMessage() for r in caplog.records if "rotary_fusion_fallback" in r.getMessage()]


@pytest.fixture
def spy(monkeypatch):
    """Counts the fused op's calls from a fusion family module (``spy(module)`` -> list of kwargs)."""
    def install(module):
        calls = []
        real = module.rotary_flash_attention

        def counting(*args, **kwargs):
            calls.append(kwargs)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, "rotary_flash_attention", counting)
        return calls
    return install
