"""``python -m ms_rope_attention.op_info`` prints the semantics table of docs/semantics.md; with ``--others``, the
tables of the other six ops (RotaryPagedAttention, RotaryCacheWrite, RfaLinear, RfaSwiGLU, RfaEmbedding, RfaRMSNorm); with ``--opdef``,
the CANN OpDef body included by aclnn/op_host/rotary_flash_attention.cpp (written to
op_host/rotary_flash_attention_opdef.h); with ``--opdef --backward``, the gradient op's, included by
op_host/rotary_flash_attention_grad.cpp (written to op_host/rotary_flash_attention_grad_opdef.h)."""
import sys

from . import OTHER_CONTRACTS, load_contract, markdown_table, opdef_source

args = sys.argv[1:]
if "--opdef" in args:
    print(opdef_source(backward="--backward" in args), end="")
elif "--others" in args:
    print("\n\n".join(markdown_table(load_contract(str(path))) for path in OTHER_CONTRACTS))
else:
    print(markdown_table())
