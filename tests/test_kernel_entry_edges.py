"""The C entries refuse what they cannot read, before touching memory (issue 37, requirement 1 and
10): null attributes, dtype names and data pointers, missing ranks, element counts that overflow,
unbounded tile knobs; the library directory override, each library file in it (its mode, owner
and where a symlink leads) and the ABI version are checked when a library is opened. Every refusal returns 1 with a message naming what is wrong."""
import ctypes
import os
import re
from pathlib import Path

import numpy as np
import pytest

from ms_rope_attention import cpu_kernel, cpu_runtime, linear
from ms_rope_attention.cpu_runtime import built_libraries, usable_isas
from ms_rope_attention.testing import cpu_direct

ISAS = [isa for isa in usable_isas() if isa in built_libraries()]
ROOT = Path(__file__).resolve().parents[1]


def _problem(rng=np.random.default_rng(0)):
    q = rng.standard_normal((1, 4, 5, 8))
    k, v = rng.standard_normal((1, 2, 5, 8)), rng.standard_normal((1, 2, 5, 8))
    cos, sin = np.ones((5, 8)), np.zeros((5, 8))
    return q, k, v, cos, sin


def _call(isa, edit=None, **knobs):
    """(return code, last error) of one forward launch whose C arguments ``edit(args)`` may change."""
    args, outputs, keep = cpu_direct.prepare(*_problem(), head_num=4)
    args = list(args)
    if edit:
        edit(args)
    code = cpu_direct.launch(tuple(args), isa=isa, **knobs)
    del keep
    return code, cpu_direct.cpu_library(isa).RotaryFlashAttentionLastError().decode()


def test_a_valid_call_passes():
    for isa in ISAS:
        assert _call(isa) == (0, "") or _call(isa)[0] == 0


def _null_dtype(args):
    args[3][0] = None


def _null_data(args):
    args[4][1] = None


def _null_shape(args):
    args[2][0] = None


def _missing_rank(args):
    args[1][0] = 2  # query given as 2-D: the kernel must not read its third and fourth dims


def _huge(args):
    args[2][0][2] = 2 ** 62  # a query length whose element count overflows int64


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("edit, message", [
    (_null_dtype, r"query.*dtype"), (_null_data, r"key.*null"), (_null_shape, r"query.*shape"),
    (_missing_rank, r"query.*(rank|4-D|dims)"), (_huge, r"query.*(too many|overflow|elements)")],
    ids=["null-dtype", "null-data", "null-shape", "missing-rank", "count-overflow"])
def test_bad_c_arguments_are_refused_by_name(isa, edit, message):
    code, error = _call(isa, edit)
    assert code == 1 and re.search(message, error, re.I), error


@pytest.mark.parametrize("isa", ISAS)
def test_null_attributes_are_refused(isa):
    code, error = _call(isa, lambda args: args.__setitem__(0, None))
    assert code == 1 and "attr" in error.lower(), error


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("knob", ["rows", "kv_block", "pack_bytes", "stream_q_max"])
def test_tile_knobs_are_bounded(isa, knob):
    code, error = _call(isa, **{knob: 2 ** 62})
    assert code == 1 and knob in error, error


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("knob", ["block_q", "block_k", "splits"])
def test_backward_tile_knobs_are_bounded(isa, knob):
    q, k, v, cos, sin = _problem()
    out, lse = np.zeros_like(q), np.zeros(q.shape[:3])
    code, *_ = cpu_direct.run_grad(q, k, v, cos, sin, None, None, out, lse, np.ones_like(q), head_num=4, isa=isa,
                                   **{knob: 2 ** 62})
    assert code == 1 and knob in cpu_direct.cpu_library(isa).RotaryFlashAttentionLastError().decode()


def test_the_gemm_entry_refuses_null_dtypes_and_data():
    lib = linear.library()
    x, w, y = np.ones((2, 3), np.float32), np.ones((4, 3), np.float32), np.zeros((2, 4), np.float32)
    arrays = (x, w, y)
    ndims = (ctypes.c_int * 3)(2, 2, 2)
    shapes = (ctypes.POINTER(ctypes.c_int64) * 3)(*[(ctypes.c_int64 * 2)(*a.shape) for a in arrays])
    for broken in ("dtype", "data"):
        params = (ctypes.c_void_p * 3)(*[a.ctypes.data for a in arrays])
        dtypes = (ctypes.c_char_p * 3)(b"float32", b"float32", b"float32")
        if broken == "dtype":
            dtypes[1] = None
        else:
            params[0] = None
        assert lib.RfaLinear(3, params, ndims, shapes, dtypes, None, None) == 1
        assert lib.RfaLinearLastError().decode(), broken


@pytest.mark.parametrize("value, message", [
    ("build/sanitize", "expected an absolute directory"),
    ("/nonexistent/rfa", "cannot read"),
    (__file__, "expected a directory")])
def test_the_kernel_directory_override_must_be_an_absolute_directory(value, message, monkeypatch):
    monkeypatch.setenv("RFA_CPU_KERNEL_DIR", value)
    with pytest.raises(RuntimeError, match=f"RFA_CPU_KERNEL_DIR: {message}"):
        cpu_runtime.kernel_dir()


def test_the_kernel_directory_override_must_not_be_writable_by_others(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("RFA_CPU_KERNEL_DIR", str(shared))
    with pytest.raises(RuntimeError, match="writable by other users"):
        cpu_runtime.kernel_dir()
    os.chmod(shared, 0o755)
    assert cpu_runtime.kernel_dir() == shared


def _kernel_dirs(tmp_path, monkeypatch):
    """(the RFA_CPU_KERNEL_DIR in use, the generic kernel's file name there, a private sibling
    directory): both directories 0755 and owned by this user."""
    name = cpu_runtime.built_libraries()["generic"].name
    kernels, other = tmp_path / "kernels", tmp_path / "other"
    for directory in (kernels, other):
        directory.mkdir(mode=0o755)
    monkeypatch.setenv("RFA_CPU_KERNEL_DIR", str(kernels))
    monkeypatch.setenv("RFA_CPU_ISA", "generic")
    return kernels, name, other


@pytest.mark.parametrize("mode", [0o664, 0o646], ids=["group-writable", "other-writable"])
def test_an_override_library_writable_by_others_is_refused_before_it_is_opened(mode, tmp_path, monkeypatch):
    """Nothing is opened: the file is not even a library, so only the check stands between it and dlopen."""
    kernels, name, _ = _kernel_dirs(tmp_path, monkeypatch)
    library = kernels / name
    library.write_bytes(b"not a library")
    library.chmod(mode)
    with pytest.raises(RuntimeError, match=rf"RFA_CPU_KERNEL_DIR: {re.escape(repr(str(library)))}: writable by "
                                           r"other users or owned by another user: expected a library only you"):
        cpu_runtime.select_library()
    library.chmod(0o644)
    assert cpu_runtime.select_library() == ("generic", library)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_an_override_library_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    kernels, name, _ = _kernel_dirs(tmp_path, monkeypatch)
    library = kernels / name
    library.write_bytes(b"not a library")
    os.chown(library, 65534, 65534)
    with pytest.raises(RuntimeError, match="owned by another user: expected a library only you"):
        cpu_runtime.select_library()


def test_an_override_library_symlink_must_lead_into_a_private_directory(tmp_path, monkeypatch):
    """A symlink to a private file in a private directory is loaded; one into a directory others can
    write is refused (they could replace the file it leads to), naming the link and its target."""
    kernels, name, other = _kernel_dirs(tmp_path, monkeypatch)
    target = other / name
    target.write_bytes(b"not a library")
    (kernels / name).symlink_to(target)
    assert cpu_runtime.select_library() == ("generic", kernels / name)
    other.chmod(0o777)
    with pytest.raises(RuntimeError, match=rf"{re.escape(repr(str(kernels / name)))} \(a symlink to "
                                           rf"{re.escape(repr(str(target)))}\): its directory "
                                           rf"{re.escape(repr(str(other)))} is writable by other users"):
        cpu_runtime.select_library()


def test_a_library_of_another_abi_version_is_refused_by_name():
    path, expected = cpu_runtime.select_library()[1], cpu_kernel.ABI_VERSION + 1
    with pytest.raises(RuntimeError, match=rf"{re.escape(str(path))}: kernel ABI version {cpu_kernel.ABI_VERSION}, "
                                           rf"this package expects {expected}"):
        cpu_runtime.open_library.__wrapped__(path, cpu_runtime.Abi("RotaryFlashAttentionAbiVersion", expected))
    other = cpu_runtime.select_library(linear.STEM)[1]  # a library without the version symbol
    with pytest.raises(RuntimeError, match=rf"{re.escape(str(other))}: a kernel library without "
                                           r"RotaryFlashAttentionAbiVersion"):
        cpu_runtime.open_library.__wrapped__(other, cpu_runtime.Abi("RotaryFlashAttentionAbiVersion", expected))


def test_the_python_abi_version_is_the_c_one():
    header = (ROOT / "ms_rope_attention" / "csrc" / "rfa_problem.h").read_text()
    assert int(re.search(r"kAbiVersion = (\d+);", header).group(1)) == cpu_kernel.ABI_VERSION
