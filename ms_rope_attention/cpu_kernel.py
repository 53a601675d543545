"""Loading the fused C++ CPU kernel and registering it as a MindSpore ``ops.Custom`` aot op.

``setup.py`` builds the kernel once per instruction set (AVX-512, AVX2/FMA/F16C, baseline); the
best one this CPU supports is chosen at run time (``RFA_CPU_ISA`` forces one).
"""
from __future__ import annotations

import ctypes
import functools
import os
import stat
import sysconfig
from pathlib import Path

import mindspore as ms
from mindspore import nn, ops

from ._compat import copy_device_tag, launches_eagerly
from .gradients import FusedKernel, fused_bprop, unfused_autodiff_bprop
from .op_info import build_reg_info

KERNEL_SYMBOL = "RotaryFlashAttention"
GRAD_KERNEL_SYMBOL = "RotaryFlashAttentionGrad"
ISAS = ("avx512", "avx2", "generic")
_REQUIRED_FLAGS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
    "generic": set(),
}
_PACKAGE_DIR = Path(__file__).resolve().parent
NOT_BUILT = "the kernels are built when the package is installed: reinstall it"
FUSED_BACKWARD = True  # the library has the backward entry (tests switch it off to run the fallback)


# The version of the C layout the direct-call entries take (rfa::Attrs, mirrored by
# cpu_direct.Attrs) and of their arguments: csrc/rfa_problem.h's kAbiVersion. A library reporting
# another version is refused when it is opened.
ABI_VERSION = 2


def _private(info: os.stat_result) -> bool:
    """Whether only its owner, this user or root, can write the file or directory ``info`` is of."""
    return not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and info.st_uid in (os.geteuid(), 0)


def kernel_dir() -> Path:
    """Where the kernel builds are looked for: the package, or ``RFA_CPU_KERNEL_DIR`` (the sanitizer
    run), which must name an absolute directory that only its owner (this user or root) can write:
    the libraries found there are loaded into the process (``built_file`` checks each library too)."""
    value = os.environ.get("RFA_CPU_KERNEL_DIR")
    if not value:
        return _PACKAGE_DIR
    path = Path(value)
    if not path.is_absolute():
        raise RuntimeError(f"RFA_CPU_KERNEL_DIR: expected an absolute directory, got {value!r}")
    try:
        info = path.stat()
    except OSError as e:
        raise RuntimeError(f"RFA_CPU_KERNEL_DIR: cannot read {value!r}: {e.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise RuntimeError(f"RFA_CPU_KERNEL_DIR: expected a directory, got {value!r}")
    if not _private(info):
        raise RuntimeError(f"RFA_CPU_KERNEL_DIR: {value!r} is writable by other users or owned by another user: "
                           "expected a directory only you (or root) can write")
    return path


def cpu_flags() -> set[str]:
    """The CPU feature flags of this machine (empty where /proc/cpuinfo is unavailable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def usable_isas() -> list[str]:
    """The instruction sets this CPU can run, best first (the portable build always)."""
    flags = cpu_flags()
    return [isa for isa in ISAS if _REQUIRED_FLAGS[isa] <= flags]


def _check_override_library(path: Path) -> None:
    """A library (a regular file: ``built_file`` checks) from ``RFA_CPU_KERNEL_DIR`` must be as
    private as the directory: dlopen runs its constructors before any version check, so a library
    another user can write, or replace through the directory a symlink leads into, would run their
    code in this process. Its real path must be a file only its owner (this user or root) can
    write, in a directory only its owner can write."""
    target = Path(os.path.realpath(path))
    where = f"RFA_CPU_KERNEL_DIR: {str(path)!r}" + (f" (a symlink to {str(target)!r})" if path.is_symlink() else "")
    info, folder = target.stat(), target.parent.stat()
    if not _private(info):
        raise RuntimeError(f"{where}: writable by other users or owned by another user: expected a library only "
                           "you (or root) can write")
    if not _private(folder):
        raise RuntimeError(f"{where}: its directory {str(target.parent)!r} is writable by other users or owned by "
                           "another user: expected one only you (or root) can write")


def built_file(stem: str) -> Path | None:
    """The built extension ``stem`` (e.g. ``_rfa_cpu_avx2``) in the kernel directory, by this
    interpreter's extension suffix (never a guess among several files), or None."""
    path = kernel_dir() / f"{stem}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    if not path.is_file():
        return None
    if os.environ.get("RFA_CPU_KERNEL_DIR"):
        _check_override_library(path)
    return path


def built_libraries(stem: str = "_rfa_cpu") -> dict[str, Path]:
    """ISA name -> built shared library ``{stem}_{isa}`` in the kernel directory."""
    return {isa: path for isa in ISAS if (path := built_file(f"{stem}_{isa}"))}


def select_library(stem: str = "_rfa_cpu", what: str = "CPU kernel") -> tuple[str, Path]:
    """(isa, path) of the best build of library ``stem`` for this CPU (``RFA_CPU_ISA`` forces one,
    for every library alike); raises ``RuntimeError`` with the reason."""
    built = built_libraries(stem)
    if not built:
        raise RuntimeError(f"no built {what} in {kernel_dir()} ({NOT_BUILT})")
    forced = os.environ.get("RFA_CPU_ISA")
    if forced and forced not in ISAS:
        raise RuntimeError(f"RFA_CPU_ISA: expected one of {list(ISAS)}, got {forced!r}")
    for isa in usable_isas():
        if isa in built and (not forced or isa == forced):
            return isa, built[isa]
    raise RuntimeError(f"no {what} build usable on this CPU (built: {sorted(built)}, requested: {forced or 'best'})")


@functools.lru_cache(maxsize=None)
def _open(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    try:
        version_of = lib.RotaryFlashAttentionAbiVersion
    except AttributeError:
        raise RuntimeError(f"{path}: a kernel library without RotaryFlashAttentionAbiVersion, built from another "
                           f"version of ms_rope_attention ({NOT_BUILT})") from None
    version_of.restype = ctypes.c_int64
    if version_of() != ABI_VERSION:
        raise RuntimeError(f"{path}: kernel ABI version {version_of()}, this package expects {ABI_VERSION} ({NOT_BUILT})")
    lib.RotaryFlashAttentionLastError.restype = ctypes.c_char_p
    lib.RotaryFlashAttentionIsa.restype = ctypes.c_char_p
    lib.RotaryFlashAttentionDecodeCalls.restype = ctypes.c_int64
    lib.RotaryPagedAttentionLastError.restype = ctypes.c_char_p
    lib.RotaryPagedAttentionCalls.restype = ctypes.c_int64
    lib.RotaryCacheWriteRotatedKeys.restype = ctypes.c_int64
    return lib


def library() -> ctypes.CDLL:
    """The selected kernel build, opened once per process (the same handle MindSpore's dlopen gets)."""
    return _open(str(select_library()[1]))


def isa_library(isa: str) -> ctypes.CDLL:
    """One ISA's kernel build, opened once per process (benchmarks measure every build this CPU runs)."""
    built = built_libraries()
    if isa not in built:
        raise RuntimeError(f"no {isa} kernel build in {kernel_dir()} (built: {sorted(built)}; {NOT_BUILT})")
    return _open(str(built[isa]))


def last_error() -> str:
    """The message of the CPU kernel's last failed launch ('' if none)."""
    return library().RotaryFlashAttentionLastError().decode()


def decode_calls() -> int:
    """Calls of the loaded kernel that took its decode path (q_len <= 16) in this process so far."""
    return library().RotaryFlashAttentionDecodeCalls()


def kernel_isa() -> str:
    """Instruction set the loaded kernel was compiled for (as the library reports it)."""
    return library().RotaryFlashAttentionIsa().decode()


class _GraphLaunch(nn.Cell):
    """One primitive as a one-node graph, compiled by ``ms.jit`` (``dynamic=1``: for the first shape,
    then once more, shape-generic, when another shape comes). A Cell, not a closure, so that each
    primitive's own launch graph is not taken for a recompiled function (MindSpore warns of that)."""

    def __init__(self, primitive):
        super().__init__()
        self.primitive = primitive
        self.compiles = 0
        self.count_compile = ops.constexpr(reuse_result=False)(self._count_compile)

    def _count_compile(self):
        self.compiles += 1
        return True

    @ms.jit(dynamic=1)
    def construct(self, *inputs):
        self.count_compile()
        return self.primitive(*inputs)


class GraphLaunchedCustom(ops.Custom):
    """An aot ``Custom`` primitive that, called eagerly (PyNative), launches through its own one-op
    graph instead of PyNative's dispatch queue; inside any graph it is an ordinary node.

    Why: PyNative runs each op on a backend thread, and the Python thread waits for that queue in a
    busy loop (MindSpore's ``AsyncRQueue::Wait``). On a CPU the spinning thread takes a core from the
    kernel's OpenMP team: a 1x32x2048x128 causal forward ran 1.5x slower than the same call in a
    GRAPH_MODE Cell. A graph launch waits without spinning and skips PyNative's per-op setup, so the
    eager call runs at graph speed and a small call costs a third of an eager launch. Gradients flow
    through the graph's bprop, i.e. the same ``bprop`` (whose backward kernel launches the same way)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.launcher = None

    @property
    def compiles(self) -> int:
        """How many times the eager launch graph was compiled (0 before the first eager call)."""
        return 0 if self.launcher is None else self.launcher.compiles

    def __call__(self, *args):
        # Traced by a bytecode (PIJit) capture: a node of that graph. Called at top level under
        # GRAPH_MODE: an eager launch as before (a graph there would compile per shape).
        if not launches_eagerly():
            return super().__call__(*args)
        if self.launcher is None:
            self.launcher = _GraphLaunch(self)
        outputs = self.launcher(*args)
        copy_device_tag(outputs, args[0])  # mindtorch's tensors carry a device tag; the outputs get the query's
        return outputs


def unavailable() -> str | None:
    """None when a kernel build for this CPU can be loaded, else why not (the dispatch's fallback reason)."""
    try:
        select_library()
    except (RuntimeError, OSError) as exc:
        return f"CPU kernel unavailable ({exc})"
    return None


def make_kernel(attrs, forwards) -> FusedKernel:
    """The aot ``Custom`` primitive for one ``attrs.OpAttrs``, differentiable through the fused
    backward kernel (the same library, its ``Grad`` entry). softmax_lse / rotated_key have
    gradients exactly when the op returns them. ``forwards`` (``gradients.AutodiffForwards``): the
    announced fallback gradient, the unfused autodiff, used only without a fused backward."""
    _, path = select_library()
    _open(str(path))  # fail here, not inside MindSpore, if the library cannot be loaded
    values, grads_used = attrs.kernel_attrs(), (attrs.with_softmax_lse, attrs.with_rotated_key)
    grad_op = None
    if FUSED_BACKWARD:
        grad_op = GraphLaunchedCustom(f"{path}:{GRAD_KERNEL_SYMBOL}", out_shape=None, out_dtype=None, func_type="aot",
                                      reg_info=build_reg_info("CPU", values, any_dtype=True, backward=True))
        bprop = fused_bprop(grad_op, *grads_used)
    else:
        bprop = unfused_autodiff_bprop(forwards.unfused, grads_used[0], "no fused backward kernel on CPU",
                                       attrs.strict or attrs.backend == "fused")
    # Shapes and dtypes come from the library's C++ InferShape/InferType (out_shape/out_dtype None): a
    # Python callable would make GRAPH_MODE with dynamic shapes and MindIR export fail.
    op = GraphLaunchedCustom(f"{path}:{KERNEL_SYMBOL}", out_shape=None, out_dtype=None, func_type="aot",
                             bprop=bprop, reg_info=build_reg_info("CPU", values, any_dtype=True))
    return FusedKernel(op, grad_op, "kernel" if grad_op is not None else "unfused")
