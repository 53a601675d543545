"""Moved to ``ms_rope_attention.testing.cpu_direct``; this path works for one release (a DeprecationWarning)."""
import sys
import warnings

from .testing import cpu_direct

warnings.warn("ms_rope_attention.cpu_direct moved to ms_rope_attention.testing.cpu_direct; this path goes in the "
              "next release", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = cpu_direct  # one module under both names, so a test's monkeypatch reaches the one in use
