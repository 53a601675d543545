"""Reference models built on ms_rope_attention."""
