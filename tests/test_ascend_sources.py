"""The Ascend op's sources as CANN would compile them, without CANN.

- op_host and every header it includes compile as the msopgen template compiles them (C++11),
  against declarations of the real CANN host API (aclnn/emulator/host_api), warnings as errors;
- the kernel entry compiles for every dtype combination of the OpDef against the emulation headers,
  warnings as errors;
- device code has no lambdas (device code may only call __aicore__ functions; GCC cannot check the
  attribute, so this is a source rule);
- the emulation headers declare names where the real ones do: code that would not compile with CANN
  does not compile here either.
"""
import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ACLNN = ROOT / "ms_rope_attention" / "aclnn"
EMULATOR = ACLNN / "emulator"
CXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(CXX is None, reason="needs g++")


def compile_(source: Path, std: str, *flags: str, includes=(), system_includes=()) -> subprocess.CompletedProcess:
    cmd = [CXX, f"-std={std}", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", *flags,
           *(f"-isystem{d}" for d in system_includes), *(f"-I{d}" for d in includes), str(source)]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.parametrize("library", ["", "-DOP_PROTO_LIB", "-DOP_TILING_LIB"])
def test_op_host_compiles_as_cann_compiles_it(library):
    """In each of the three builds CANN makes of op_host (the op definition, the proto library, the
    tiling library: OP_ADD expands differently in each), the host API as system headers, as CANN's are."""
    result = compile_(ACLNN / "op_host" / "rotary_flash_attention.cpp", "c++11", *filter(None, [library]),
                      system_includes=(EMULATOR / "host_api",),
                      includes=(EMULATOR, ACLNN / "op_kernel", ACLNN / "op_host", ROOT / "ms_rope_attention" / "csrc"))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("query,table", list(itertools.product(["float", "half", "bfloat16_t"], repeat=2)))
def test_kernel_entry_compiles_for_every_dtype(query, table):
    result = compile_(ACLNN / "op_kernel" / "rotary_flash_attention.cpp", "c++17", f"-DDTYPE_QUERY={query}",
                      f"-DDTYPE_COS={table}", includes=(EMULATOR, ACLNN / "op_kernel"))
    assert result.returncode == 0, result.stderr


def strip_comments(code: str) -> str:
    code = re.sub(r"/\*.*?\*/", " ", code, flags=re.S)
    return re.sub(r"//[^\n]*", " ", code)


# A lambda introducer: '[' not after a name, ']' or ')' (which would make it a subscript), then
# a capture list, then '(' or '{'.
LAMBDA = re.compile(r"(?<![\w\]\)\s])\s*\[[^\[\]]*\]\s*[({]|[=(,]\s*\[[^\[\]]*\]\s*[({]")


def test_device_code_has_no_lambdas():
    for path in sorted((ACLNN / "op_kernel").iterdir()):
        code = strip_comments(path.read_text())
        found = LAMBDA.search(code)
        assert found is None, f"{path.name}: lambda in device code: {found.group(0)!r}"


def test_the_lambda_rule_sees_lambdas():
    for code in ("auto f = [&](int i) { return i; };", "Visit(t, [this](int b) { return b; });",
                 "F(x, [](int) {})"):
        assert LAMBDA.search(code), code
    for code in ("a[i] = b[j];", "x = rows[r * nb];", "f(s[r * nb], 1);"):
        assert not LAMBDA.search(code), code


# Snippets that compile with the real headers only where the real headers put the names, and
# positions the A2 Matmul API refuses: each must fail to compile against the emulation headers.
PRELUDE = '#include "kernel_operator.h"\n#include "lib/matmul_intf.h"\nusing namespace AscendC;\n'
MATMUL = ("using A = matmul::MatmulType<TPosition::GM, CubeFormat::ND, float>;\n"
          "using C_{0} = matmul::MatmulType<TPosition::{0}, CubeFormat::ND, float>;\n")
REFUSED = {
    "PIPE_ALL in AscendC": "void f() { PipeBarrier<AscendC::PIPE_ALL>(); }",
    "GetSysWorkSpacePtr in AscendC": "GM_ADDR f() { return AscendC::GetSysWorkSpacePtr(); }",
    "Matmul C at VECCALC": MATMUL.format("VECCALC") + "matmul::Matmul<A, A, C_VECCALC, A> mm;",
    "Matmul bias defaulting to C's VECIN": MATMUL.format("VECIN") + "matmul::Matmul<A, A, C_VECIN> mm;",
}
ACCEPTED = {
    "global PIPE_ALL": "void f() { PipeBarrier<PIPE_ALL>(); }",
    "global GetSysWorkSpacePtr": "GM_ADDR f() { return GetSysWorkSpacePtr(); }",
    "Matmul C at VECIN, bias at GM": MATMUL.format("VECIN") + "matmul::Matmul<A, A, C_VECIN, A> mm;",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_emulation_headers_refuse_what_cann_refuses(name, tmp_path):
    source = tmp_path / "snippet.cpp"
    source.write_text(PRELUDE + REFUSED[name] + "\n")
    assert compile_(source, "c++17", includes=(EMULATOR,)).returncode != 0


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_emulation_headers_accept_the_real_spelling(name, tmp_path):
    source = tmp_path / "snippet.cpp"
    source.write_text(PRELUDE + ACCEPTED[name] + "\n")
    result = compile_(source, "c++17", "-Wno-unused-variable", includes=(EMULATOR,))
    assert result.returncode == 0, result.stderr
