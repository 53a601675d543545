"""``python -m ms_rope_attention.op_info`` prints the semantics table of docs/semantics.md; with ``--paged``, the
tables of the paged cache's two ops (RotaryPagedAttention, RotaryCacheWrite); with ``--opdef``, the
CANN OpDef body included by aclnn/op_host/rotary_flash_attention.cpp (written to op_host/rotary_flash_attention_opdef.h);
with ``--opdef --backward``, the gradient op's, included by op_host/rotary_flash_attention_grad.cpp (written to
op_host/rotary_flash_attention_grad_opdef.h)."""
import sys

from . import CACHE_WRITE_PATH, PAGED_ATTENTION_PATH, load_contract, markdown_table, opdef_source

args = sys.argv[1:]
if "--opdef" in args:
    print(opdef_source(backward="--backward" in args), end="")
elif "--paged" in args:
    print("\n\n".join(markdown_table(load_contract(str(path))) for path in (PAGED_ATTENTION_PATH, CACHE_WRITE_PATH)))
else:
    print(markdown_table())
