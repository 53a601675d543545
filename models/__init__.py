"""Reference models built on ms_rope_attention."""
import ms_rope_attention  # noqa: F401  first, before MindSpore: it sets the kernels' OpenMP wait policy
