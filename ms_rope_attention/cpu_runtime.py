"""The CPU op runtime, one way for every op: which build of a kernel library this CPU runs, the
library opened once, its aot entries called directly (tests, sanitizer, benchmarks), and the op's
primitive made from its contract.

``setup.py`` builds each library once per instruction set (AVX-512, AVX2/FMA/F16C, baseline); the
best one this CPU supports is chosen at run time (``RFA_CPU_ISA`` forces one, for every library).
Why one room: five ops (attention, paged attention, cache write, linear, embedding) had three ways
to load and register themselves, and the sixth would have copied whichever was nearest.
"""
from __future__ import annotations

import ctypes
import functools
import os
import stat
import sysconfig
from pathlib import Path
from typing import NamedTuple

import mindspore as ms
from mindspore import nn, ops

from ._compat import copy_device_tag, launches_eagerly
from .isas import ISAS, cpu_flags, usable_isas  # noqa: F401  (this module's names before isas.py)
from .op_info import Contract, build_reg_info

_PACKAGE_DIR = Path(__file__).resolve().parent
NOT_BUILT = "the kernels are built when the package is installed: reinstall it"


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


def library_path(stem: str, what: str, isa: str | None = None) -> Path:
    """The selected build of library ``stem`` (``select_library``), or ``isa``'s (tests and
    benchmarks measure every build this CPU runs)."""
    if isa is None:
        return select_library(stem, what)[1]
    built = built_libraries(stem)
    if isa not in built:
        raise RuntimeError(f"no {isa} build of the {what} in {kernel_dir()} (built: {sorted(built)}; {NOT_BUILT})")
    return built[isa]


class Abi(NamedTuple):
    """A library's layout version: its C entry ``symbol`` must answer ``version``."""
    symbol: str
    version: int


@functools.lru_cache(maxsize=None)
def open_library(path: Path, abi: Abi | None = None, texts: tuple = (), counts: tuple = ()) -> ctypes.CDLL:
    """The library at ``path``, opened once per process and per caller's view (the handle MindSpore's
    dlopen then shares); a library whose ``abi`` entry answers another version is refused. Each op's
    room names its own entries: ``texts`` return C strings, ``counts`` int64."""
    lib = ctypes.CDLL(str(path))
    if abi is not None:
        try:
            version_of = getattr(lib, abi.symbol)
        except AttributeError:
            raise RuntimeError(f"{path}: a kernel library without {abi.symbol}, built from another version of "
                               f"ms_rope_attention ({NOT_BUILT})") from None
        version_of.restype = ctypes.c_int64
        if version_of() != abi.version:
            raise RuntimeError(f"{path}: kernel ABI version {version_of()}, this package expects {abi.version} "
                               f"({NOT_BUILT})")
    for name in texts:
        getattr(lib, name).restype = ctypes.c_char_p
    for name in counts:
        getattr(lib, name).restype = ctypes.c_int64
    return lib


class AotCall(NamedTuple):
    """The aot calling convention's arrays for one call (MindSpore's: ndims, shapes, dtype names,
    data pointers); the caller keeps it alive until the call returns (``arrays``, ``shape_rows``)."""
    ndims: object
    shapes: object
    dtypes: object
    params: object
    arrays: list
    shape_rows: list

    def convention(self) -> tuple:
        """(ndims, shapes, dtypes, params): the direct-call (``*Run``) entries' order."""
        return self.ndims, self.shapes, self.dtypes, self.params


def aot_call(arrays, dtypes=None) -> AotCall:
    """``arrays`` (numpy; None = an absent optional input, dtype "none") in the aot calling
    convention; ``dtypes``: their names as the kernel reads them (default: each array's own)."""
    n = len(arrays)
    if dtypes is None:
        dtypes = ["none" if a is None else str(a.dtype) for a in arrays]
    ndims = (ctypes.c_int * n)(*[0 if a is None else a.ndim for a in arrays])
    rows = [(ctypes.c_int64 * max(1, 0 if a is None else a.ndim))(*(() if a is None else a.shape)) for a in arrays]
    shapes = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(r, ctypes.POINTER(ctypes.c_int64)) for r in rows])
    names = (ctypes.c_char_p * n)(*[d.encode() for d in dtypes])
    params = (ctypes.c_void_p * n)(*[None if a is None else a.ctypes.data for a in arrays])
    return AotCall(ndims, shapes, names, params, list(arrays), rows)


def direct_call(lib: ctypes.CDLL, entry: str, arrays, error_entry: str) -> None:
    """The aot entry ``entry`` called directly on numpy arrays (inputs then outputs), as MindSpore
    launches it; ValueError with the library's message (``error_entry``) when it refuses the call."""
    call = aot_call(arrays)
    if getattr(lib, entry)(len(arrays), call.params, call.ndims, call.shapes, call.dtypes, None, None):
        raise ValueError(getattr(lib, error_entry)().decode())


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


def make_primitive(contract: Contract, values: dict, path: Path, *, bprop=None, side_effect: bool = False,
                   any_dtype: bool = True, graph_launch: bool = True) -> ops.Custom:
    """The aot primitive of ``contract``'s op (its entry is the op's name in the library at
    ``path``), registered with these attribute ``values`` (missing ones: the contract's defaults).

    Shapes and dtypes come from the library's C++ InferShape/InferType (out_shape/out_dtype None): a
    Python callable would make GRAPH_MODE with dynamic shapes and MindIR export fail. ``any_dtype``:
    the kernel checks dtypes itself (``build_reg_info``). ``side_effect``: the op writes its inputs in
    place, so it is kept in order and never pruned. ``graph_launch``: called eagerly, it launches
    through its own one-op graph (``GraphLaunchedCustom``)."""
    kind = GraphLaunchedCustom if graph_launch else ops.Custom
    op = kind(f"{path}:{contract.op_name}", out_shape=None, out_dtype=None, func_type="aot", bprop=bprop,
              reg_info=build_reg_info("CPU", values, any_dtype=any_dtype, contract=contract))
    if side_effect:
        op.add_prim_attr("side_effect_mem", True)
    return op
