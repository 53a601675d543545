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

Each compile parses the emulation's standard headers (~1.5 s): where one translation unit can hold
several cases (the dtype combinations of one kernel entry, the snippets), it does.
"""
import functools
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
pytestmark = [pytest.mark.skipif(CXX is None, reason="needs g++"),
              pytest.mark.xdist_group("ascend_sources")]  # one worker: each shared compile runs once


def compile_(source: Path, std: str, *flags: str, includes=()) -> subprocess.CompletedProcess:
    cmd = [CXX, f"-std={std}", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", *flags,
           *(f"-I{d}" for d in includes), str(source)]
    return subprocess.run(cmd, capture_output=True, text=True)


LIBRARIES = ["", "-DOP_PROTO_LIB", "-DOP_TILING_LIB"]
OP_HOST = ["rotary_flash_attention.cpp", "rotary_flash_attention_grad.cpp"]  # the forward's, the backward's
OP_HOST_INCLUDES = (EMULATOR, ACLNN / "op_kernel", ACLNN / "op_host", ROOT / "ms_rope_attention" / "csrc")


def compile_object(source: Path, obj: Path, *flags: str) -> subprocess.CompletedProcess:
    """``source`` compiled to ``obj`` as an op_host file of the msopgen template (C++11, position-independent,
    the host API as system headers, as CANN's are), warnings as errors."""
    cmd = [CXX, "-std=c++11", "-c", "-fPIC", "-Wall", "-Wextra", "-Werror", *flags,
           f"-isystem{EMULATOR / 'host_api'}", *(f"-I{d}" for d in OP_HOST_INCLUDES), str(source), "-o", str(obj)]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def op_host_object(tmp_path_factory):
    """(library, source) -> the compile of op_host/``source`` to an object file for that library (once: the
    compile test and the link test read the same one)."""
    folder = tmp_path_factory.mktemp("op_host")

    @functools.cache
    def build(library: str, source: str) -> tuple[subprocess.CompletedProcess, Path]:
        obj = folder / f"{Path(source).stem}{library}.o"
        return compile_object(ACLNN / "op_host" / source, obj, *filter(None, [library])), obj
    return build


@pytest.mark.parametrize("source", OP_HOST)
@pytest.mark.parametrize("library", LIBRARIES)
def test_op_host_compiles_as_cann_compiles_it(library, source, op_host_object):
    """In each of the three builds CANN makes of op_host (the op definition, the proto library, the
    tiling library: OP_ADD expands differently in each), the host API as system headers, as CANN's are."""
    result, _ = op_host_object(library, source)
    assert result.returncode == 0, result.stderr


def strong_definitions(objects) -> list:
    """Per object file, the external symbols it defines strongly (code, data, bss, read-only data): two
    such definitions of one name do not link into one library."""
    defined = []
    for obj in objects:
        listing = subprocess.run([NM, "--defined-only", str(obj)], capture_output=True, text=True, check=True).stdout
        defined.append({fields[2] for fields in map(str.split, listing.splitlines())
                        if len(fields) == 3 and fields[1] in "TDBR"})
    return defined


@pytest.mark.skipif(NM is None, reason="needs nm")
@pytest.mark.parametrize("library", LIBRARIES)
def test_op_host_files_link_into_one_library(library, op_host_object):
    """The msopgen template compiles every op_host/*.cpp into the same libraries (opbuild's, the proto
    and the tiling library): the two ops' files must not both define an external symbol."""
    objects = []
    for source in OP_HOST:
        result, obj = op_host_object(library, source)
        assert result.returncode == 0, result.stderr
        objects.append(obj)
    defined = strong_definitions(objects)
    assert not set.intersection(*defined), f"defined by both op_host files: {sorted(set.intersection(*defined))}"


@pytest.mark.skipif(NM is None, reason="needs nm")
def test_the_one_library_check_sees_a_duplicate(tmp_path):
    sources = [tmp_path / "a.cpp", tmp_path / "b.cpp"]
    for source in sources:
        source.write_text("int Shared() { return 1; }\nstatic int Own() { return 2; }\nint Use() { return Own(); }\n")
    sources[1].write_text(sources[1].read_text().replace("Use", "Other"))
    for source in sources:
        result = compile_object(source, source.with_suffix(".o"))
        assert result.returncode == 0, result.stderr
    assert set.intersection(*strong_definitions(source.with_suffix(".o") for source in sources)) == {"_Z6Sharedv"}


KERNEL_ENTRIES = ["rotary_flash_attention.cpp", "rotary_flash_attention_grad.cpp"]  # the forward's, the backward's


DTYPES = list(itertools.product(["float", "half", "bfloat16_t"], repeat=2))  # (DTYPE_QUERY, DTYPE_COS)


@pytest.mark.parametrize("entry", KERNEL_ENTRIES)
def test_kernel_entry_compiles_for_every_dtype(entry, tmp_path):
    """Every dtype combination in one translation unit: the entry once per combination, with DTYPE_QUERY and
    DTYPE_COS defined as CANN's -D flags define them and the entry function renamed; each copy instantiates
    its own kernel class, and the headers (#pragma once) are parsed once, not nine times."""
    function = Path(entry).stem
    source = tmp_path / f"every_dtype_{entry}"
    source.write_text("".join(
        f"#define DTYPE_QUERY {query}\n#define DTYPE_COS {table}\n#define {function} {function}_{query}_{table}\n"
        f'#include "{ACLNN / "op_kernel" / entry}"\n#undef DTYPE_QUERY\n#undef DTYPE_COS\n#undef {function}\n'
        for query, table in DTYPES))
    result = compile_(source, "c++17", includes=(EMULATOR, ACLNN / "op_kernel"))
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


def compile_snippets(snippets: dict, folder: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """``snippets`` in one translation unit after PRELUDE, each in a namespace of its own; (the compile, name ->
    the lines of the compiler's output that point into that snippet: its errors, or "required from here")."""
    source, code, lines = folder / "snippets.cpp", PRELUDE, {}
    for index, (name, snippet) in enumerate(sorted(snippets.items())):
        first = code.count("\n") + 2  # the line after the namespace's opening
        code += f"namespace snippet_{index} {{\n{snippet}\n}}\n"
        lines[name] = range(first, code.count("\n"))
    source.write_text(code)
    result = compile_(source, "c++17", "-Wno-unused-variable", includes=(EMULATOR,))
    pointing = list(re.finditer(rf"^{re.escape(str(source))}:(\d+):\d+:.*$", result.stderr, flags=re.M))
    return result, {name: [m.group(0) for m in pointing if int(m.group(1)) in lines[name]] for name in snippets}


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    return compile_snippets(REFUSED, tmp_path_factory.mktemp("refused"))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_emulation_headers_refuse_what_cann_refuses(name, refused):
    """Its own lines fail: an error there, or a failed instantiation required from there (a specialization
    another snippet had already failed would report nothing here: each snippet's must differ)."""
    result, pointing = refused
    assert pointing[name], result.stderr


@pytest.fixture(scope="module")
def accepted(tmp_path_factory):
    return compile_snippets(ACCEPTED, tmp_path_factory.mktemp("accepted"))


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_emulation_headers_accept_the_real_spelling(name, accepted):
    """The translation unit of all of them compiles (a failure's output names the snippet's lines)."""
    result, _ = accepted
    assert result.returncode == 0, result.stderr
