"""The fused attention's CPU kernel: its library (one build per instruction set, chosen by
``cpu_runtime``), its diagnostics and ``make_kernel``, the dispatch's factory for the CPU.
"""
from __future__ import annotations

import ctypes

from .attrs import check_attention_compute_dtype
from .cpu_runtime import Abi, cpu_flags, library_path, make_primitive, open_library, select_library
from .cpu_runtime import built_libraries, usable_isas  # noqa: F401  (the benchmarks' old path, for one release)
from .gradients import FusedKernel, fused_bprop, unfused_autodiff_bprop
from .op_info import load_contract

STEM, WHAT = "_rfa_cpu", "CPU kernel"
FUSED_BACKWARD = True  # the library has the backward entry (tests switch it off to run the fallback)

# The version of the C layout the direct-call entries take (rfa::Attrs, mirrored by
# testing.cpu_direct.Attrs) and of their arguments: csrc/rfa_problem.h's kAbiVersion. A library
# reporting another version is refused when it is opened.
ABI_VERSION = 3
ABI = Abi("RotaryFlashAttentionAbiVersion", ABI_VERSION)  # paged_kernel opens the same library: the same check


def library(isa: str | None = None) -> ctypes.CDLL:
    """The selected kernel build (or ``isa``'s), opened once per process (the handle MindSpore's
    dlopen gets)."""
    return open_library(library_path(STEM, WHAT, isa), ABI,
                        texts=("RotaryFlashAttentionLastError", "RotaryFlashAttentionIsa",
                               "RotaryFlashAttentionBf16Units"),
                        counts=("RotaryFlashAttentionDecodeCalls", "RotaryFlashAttentionNativeBf16",
                                "RotaryFlashAttentionAmx"))


def isa_library(isa: str) -> ctypes.CDLL:
    """One ISA's kernel build (benchmarks measure every build this CPU runs)."""
    return library(isa)


def last_error() -> str:
    """The message of the CPU kernel's last failed launch ('' if none)."""
    return library().RotaryFlashAttentionLastError().decode()


def decode_calls() -> int:
    """Calls of the loaded kernel that took its decode path (q_len <= 16) in this process so far."""
    return library().RotaryFlashAttentionDecodeCalls()


def kernel_isa() -> str:
    """Instruction set the loaded kernel was compiled for (as the library reports it)."""
    return library().RotaryFlashAttentionIsa().decode()


def native_bfloat16(isa: str | None = None) -> bool:
    """Whether the loaded build (or ``isa``'s) computes bfloat16 products on this CPU: the avx512 build
    on a CPU with avx512_bf16 (the kernel's own answer)."""
    return bool(library(isa).RotaryFlashAttentionNativeBf16())


def bfloat16_units(isa: str | None = None) -> str:
    """What the bfloat16 forward's tiled path multiplies on in this process, and why: 'amx' (AMX-BF16
    tiles), 'avx512_bf16: <rates>' (vdpbf16ps), 'fma: <rates>' (the same rounded operands on the float32
    FMAs, where this CPU's vdpbf16ps is the slower unit: csrc/bf16_probe.h), or '<unit>:
    RFA_BF16_ATTENTION=<value>' when that variable chooses; '' where this build and CPU have no bfloat16
    arithmetic."""
    return library(isa).RotaryFlashAttentionBf16Units().decode()


def bfloat16_tiles(allow_amx: bool | None = None, isa: str | None = None) -> str | None:
    """The unit the bfloat16 forward multiplies on: 'amx', 'avx512_bf16', 'fma' (``bfloat16_units``
    without its reason), or None (no bfloat16 arithmetic in this build on this CPU). ``allow_amx``
    switches the tiles on or off for this process first (tests and benchmarks measure both; default
    on); RFA_BF16_ATTENTION=dot|fma chooses between the others (a bad value: ValueError)."""
    library(isa).RotaryFlashAttentionAmx(ctypes.c_int64(-1 if allow_amx is None else int(allow_amx)))
    units = bfloat16_units(isa)
    if units.startswith("RFA_BF16_ATTENTION"):
        raise ValueError(units)
    return units.split(":")[0] or None


def compute_dtype_for(requested: str, input_dtype: str, isa: str | None = None) -> str:
    """The arithmetic of Q K^T and P V ('float32' or 'bfloat16') the kernel runs for the setting
    ``requested`` and inputs (or a KV cache) of ``input_dtype``, as the kernel resolves it at launch
    (csrc/rfa_problem.h ResolveCompute; ``compute.resolve_compute_dtype``'s rule with this build's own
    bfloat16 capability for the CPU's): 'auto' is bfloat16 for bfloat16 inputs where the build
    computes it, float32 otherwise. An explicit 'bfloat16' it cannot compute is refused (ValueError),
    as the kernel refuses it."""
    check_attention_compute_dtype(requested)
    native = native_bfloat16(isa)
    if requested == "bfloat16" and not native:
        where = "" if "avx512_bf16" in cpu_flags() else " on a CPU without avx512_bf16"
        raise ValueError(f"compute_dtype: 'bfloat16' needs the avx512_bf16 instructions (vdpbf16ps) and the kernel's "
                         f"avx512 build; this is the {kernel_isa() if isa is None else isa} build{where}; "
                         "use 'auto' or 'float32'")
    if requested == "auto":
        return "bfloat16" if native and input_dtype == "bfloat16" else "float32"
    return requested


def unavailable() -> str | None:
    """None when a kernel build for this CPU can be loaded, else why not (the dispatch's fallback reason)."""
    try:
        select_library(STEM, WHAT)
    except (RuntimeError, OSError) as exc:
        return f"CPU kernel unavailable ({exc})"
    return None


def make_kernel(attrs, forwards) -> FusedKernel:
    """The aot ``Custom`` primitive for one ``attrs.OpAttrs``, differentiable through the fused
    backward kernel (the same library, its ``Grad`` entry). softmax_lse / rotated_key have
    gradients exactly when the op returns them. ``forwards`` (``gradients.AutodiffForwards``): the
    announced fallback gradient, the unfused autodiff, used only without a fused backward."""
    path = library_path(STEM, WHAT)
    library()  # fail here, not inside MindSpore, if the library cannot be loaded
    compute_dtype_for(attrs.compute_dtype, "bfloat16")  # an explicit bfloat16 this build cannot compute: refused now
    contract, values = load_contract(), attrs.kernel_attrs()
    grads_used = attrs.with_softmax_lse, attrs.with_rotated_key
    grad_op = None
    if FUSED_BACKWARD:
        grad_op = make_primitive(contract.backward, values, path)
        bprop = fused_bprop(grad_op, *grads_used)
    else:
        bprop = unfused_autodiff_bprop(forwards.unfused, grads_used[0], "no fused backward kernel on CPU",
                                       attrs.strict or attrs.backend == "fused")
    op = make_primitive(contract, values, path, bprop=bprop)
    return FusedKernel(op, grad_op, "kernel" if grad_op is not None else "unfused")
