"""``python -m ms_rope_attention.op_info`` prints the README's semantics table."""
from . import markdown_table

print(markdown_table())
