"""The CPU kernel as a plain C++ program checked against a float64 reference written in C++
(tests/cross/kernel_vs_reference.cc): natively here, and for aarch64, the host CPU of Ascend
servers, with a cross compiler and qemu-user where they are installed (Debian packages
g++-aarch64-linux-gnu and qemu-user; skipped, saying so, where they are not). The float16 conversion
the kernels read half caches with (tests/cross/half_conversion.cc) is checked the same way, for
every instruction set this CPU runs."""
import shutil
import subprocess
from pathlib import Path

import pytest

from ms_rope_attention.isas import COMPILER_FLAGS, usable_isas  # setup.py's builds' flags

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "ms_rope_attention" / "csrc"
KERNEL = [CSRC / name for name in ("rfa_cpu_kernel.cc", "rfa_cpu_decode.cc", "rfa_cpu_backward.cc", "rfa_cpu_aot.cc")]
LINEAR = [CSRC / name for name in ("rfa_cpu_linear.cc", "rfa_cpu_embedding.cc")]
DRIVER = ROOT / "tests" / "cross" / "kernel_vs_reference.cc"
HALF_DRIVER = ROOT / "tests" / "cross" / "half_conversion.cc"
WEIGHTS_DRIVER = ROOT / "tests" / "cross" / "weight_rows.cc"  # the projection library's product
FLAGS = ["-std=c++17", "-O2", "-fopenmp", "-Wall", "-Wextra", "-Werror", f"-I{CSRC}"]
AARCH64_CXX = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64")
SYSROOT = Path("/usr/aarch64-linux-gnu")


def build(compiler: str, out: Path) -> Path:
    result = subprocess.run([compiler, *FLAGS, *map(str, KERNEL), str(DRIVER), "-o", str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return out


def build_half(compiler: str, out: Path, flags=(), driver: Path = HALF_DRIVER) -> Path:
    result = subprocess.run([compiler, *FLAGS, *flags, str(driver), "-o", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return out


def check_run(cmd, expected="0 of 11 cases failed") -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert expected in result.stdout


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_native_program_matches_reference(tmp_path):
    check_run([str(build("g++", tmp_path / "kernel_vs_reference"))])


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("isa", usable_isas())
def test_half_conversion_is_exact_for_every_pattern(tmp_path, isa):
    program = build_half("g++", tmp_path / f"half_{isa}", COMPILER_FLAGS[isa])
    check_run([str(program)], f"{isa}: 0 of 65536 float16 patterns differ")


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("isa", usable_isas())
def test_half_weight_product_matches_reference(tmp_path, isa):
    program = build_half("g++", tmp_path / f"weights_{isa}", COMPILER_FLAGS[isa], WEIGHTS_DRIVER)
    check_run([str(program)], f"{isa}: 0 of 27 product cases failed, 0 of 65536 bfloat16 patterns differ")


@pytest.mark.integration
@pytest.mark.skipif(AARCH64_CXX is None, reason="needs aarch64-linux-gnu-g++ (Debian g++-aarch64-linux-gnu)")
def test_aarch64_build_compiles_warning_free(tmp_path):
    import scipy_openblas32  # the projection library's cblas.h (architecture-independent declarations)
    for source in KERNEL + LINEAR:
        result = subprocess.run([AARCH64_CXX, *FLAGS, f"-I{scipy_openblas32.get_include_dir()}", "-c", str(source),
                                 "-o", str(tmp_path / f"{source.stem}.o")], capture_output=True, text=True)
        assert result.returncode == 0, f"{source.name}: {result.stderr}"


@pytest.mark.integration
@pytest.mark.skipif(AARCH64_CXX is None or QEMU is None,
                    reason="needs aarch64-linux-gnu-g++ and qemu-aarch64 (Debian g++-aarch64-linux-gnu, qemu-user)")
def test_aarch64_program_matches_reference_under_qemu(tmp_path):
    program = build(AARCH64_CXX, tmp_path / "kernel_vs_reference_aarch64")
    check_run([QEMU, "-L", str(SYSROOT), str(program)])
    half = build_half(AARCH64_CXX, tmp_path / "half_aarch64")
    check_run([QEMU, "-L", str(SYSROOT), str(half)], "generic: 0 of 65536 float16 patterns differ")
    weights = build_half(AARCH64_CXX, tmp_path / "weights_aarch64", driver=WEIGHTS_DRIVER)
    check_run([QEMU, "-L", str(SYSROOT), str(weights)], "generic: 0 of 27 product cases failed, 0 of 65536 bfloat16")
