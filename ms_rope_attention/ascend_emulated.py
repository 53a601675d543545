"""Moved to ``ms_rope_attention.testing.ascend_emulated``; this path works for one release (a DeprecationWarning)."""
import sys
import warnings

from .testing import ascend_emulated

warnings.warn("ms_rope_attention.ascend_emulated moved to ms_rope_attention.testing.ascend_emulated; this path "
              "goes in the next release", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = ascend_emulated  # one module under both names, so a test's monkeypatch reaches the one in use
