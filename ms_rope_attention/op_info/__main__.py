"""``python -m ms_rope_attention.op_info`` prints the semantics table of docs/semantics.md; with ``--opdef``, the
CANN OpDef body included by aclnn/op_host/rotary_flash_attention.cpp (written to op_host/rotary_flash_attention_opdef.h)."""
import sys

from . import markdown_table, opdef_source

print(opdef_source() if "--opdef" in sys.argv[1:] else markdown_table(), end="" if "--opdef" in sys.argv[1:] else "\n")
