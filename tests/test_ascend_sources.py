"""The Ascend op's sources as CANN would compile them, without CANN.

- both ops' op_host files and every header they include compile as the msopgen template compiles
  them (C++11), against declarations of the real CANN host API (aclnn/emulator/host_api), warnings as
  errors, and can be linked into the one library the template makes of them;
- both kernel entries compile for every dtype combination of the OpDef against the emulation
  headers, warnings as errors;
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
NM = shutil.which("nm")
pytestmark = pytest.mark.skipif(CXX is None, reason="needs g++")


def compile_(source: Path, std: str, *flags: str, includes=(), system_includes=()) -> subprocess.CompletedProcess:
    cmd = [CXX, f"-std={std}", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", *flags,
           *(f"-isystem{d}" for d in system_includes), *(f"-I{d}" for d in includes), str(source)]
    return subprocess.run(cmd, capture_output=True, text=True)


LIBRARIES = ["", "-DOP_PROTO_LIB", "-DOP_TILING_LIB"]
OP_HOST = ["rotary_flash_attention.cpp", "rotary_flash_attention_grad.cpp"]  # the forward's, the backward's
OP_HOST_INCLUDES = (EMULATOR, ACLNN / "op_kernel", ACLNN / "op_host", ROOT / "ms_rope_attention" / "csrc")


@pytest.mark.parametrize("source", OP_HOST)
@pytest.mark.parametrize("library", LIBRARIES)
def test_op_host_compiles_as_cann_compiles_it(library, source):
    """In each of the three builds CANN makes of op_host (the op definition, the proto library, the
    tiling library: OP_ADD expands differently in each), the host API as system headers, as CANN's are."""
    result = compile_(ACLNN / "op_host" / source, "c++11", *filter(None, [library]),
                      system_includes=(EMULATOR / "host_api",), includes=OP_HOST_INCLUDES)
    assert result.returncode == 0, result.stderr


def strong_definitions(sources, tmp_path, *flags: str) -> list:
    """Per source, the external symbols its object file defines strongly (code, data, bss, read-only
    data): two such definitions of one name do not link into one library."""
    defined = []
    for index, source in enumerate(sources):
        obj = tmp_path / f"{index}.o"
        cmd = [CXX, "-std=c++11", "-c", "-fPIC", *flags, f"-isystem{EMULATOR / 'host_api'}",
               *(f"-I{d}" for d in OP_HOST_INCLUDES), str(source), "-o", str(obj)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        listing = subprocess.run([NM, "--defined-only", str(obj)], capture_output=True, text=True, check=True).stdout
        defined.append({fields[2] for fields in map(str.split, listing.splitlines())
                        if len(fields) == 3 and fields[1] in "TDBR"})
    return defined


@pytest.mark.skipif(NM is None, reason="needs nm")
@pytest.mark.parametrize("library", LIBRARIES)
def test_op_host_files_link_into_one_library(library, tmp_path):
    """The msopgen template compiles every op_host/*.cpp into the same libraries (opbuild's, the proto
    and the tiling library): the two ops' files must not both define an external symbol."""
    defined = strong_definitions([ACLNN / "op_host" / source for source in OP_HOST], tmp_path, *filter(None, [library]))
    assert not set.intersection(*defined), f"defined by both op_host files: {sorted(set.intersection(*defined))}"


@pytest.mark.skipif(NM is None, reason="needs nm")
def test_the_one_library_check_sees_a_duplicate(tmp_path):
    sources = [tmp_path / "a.cpp", tmp_path / "b.cpp"]
    for source in sources:
        source.write_text("int Shared() { return 1; }\nstatic int Own() { return 2; }\nint Use() { return Own(); }\n")
    sources[1].write_text(sources[1].read_text().replace("Use", "Other"))
    assert set.intersection(*strong_definitions(sources, tmp_path)) == {"_Z6Sharedv"}


KERNEL_ENTRIES = ["rotary_flash_attention.cpp", "rotary_flash_attention_grad.cpp"]  # the forward's, the backward's


@pytest.mark.parametrize("query,table", list(itertools.product(["float", "half", "bfloat16_t"], repeat=2)))
@pytest.mark.parametrize("entry", KERNEL_ENTRIES)
def test_kernel_entry_compiles_for_every_dtype(entry, query, table):
    result = compile_(ACLNN / "op_kernel" / entry, "c++17", f"-DDTYPE_QUERY={query}",
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
