"""Installs ms_rope_attention and builds its C++ CPU kernel once per instruction set.

Each build is a plain shared library loaded by MindSpore's aot Custom op (not a Python module).
``RFA_SANITIZE=1`` builds them with AddressSanitizer + UBSan for the sanitizer test run.
"""
import os
import platform

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

CSRC = "ms_rope_attention/csrc"
SOURCES = [f"{CSRC}/rfa_cpu_kernel.cc", f"{CSRC}/rfa_cpu_backward.cc", f"{CSRC}/rfa_cpu_aot.cc"]
COMMON = ["-std=c++17", "-O3", "-fopenmp", "-D_GLIBCXX_USE_CXX11_ABI=0", "-fvisibility=hidden", "-Wall", "-Wextra"]
ISA_FLAGS = {"generic": []}
if platform.machine() in ("x86_64", "AMD64"):
    ISA_FLAGS["avx2"] = ["-mavx2", "-mfma", "-mf16c"]
    ISA_FLAGS["avx512"] = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1"] if os.environ.get("RFA_SANITIZE") else []


class BuildKernels(build_ext):
    """build_ext with one temp directory per extension: the ISA builds share source files."""

    def build_extension(self, ext):
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base

    def get_export_symbols(self, ext):
        return []  # not Python modules: no PyInit_ symbol to export


extensions = [
    Extension(f"ms_rope_attention._rfa_cpu_{isa}", sources=SOURCES, depends=[f"{CSRC}/{h}" for h in
              ("aot_abi.h", "rfa_problem.h", "rfa_cpu_kernel.h", "rows.h", "simd.h")],
              extra_compile_args=COMMON + flags + SANITIZE, extra_link_args=["-fopenmp"] + SANITIZE[:1],
              language="c++")
    for isa, flags in ISA_FLAGS.items()
]

# The projections' GEMM (y = x W^T) on OpenBLAS, from the scipy-openblas32 wheel (an install requirement,
# so it is there when pip builds this package without build isolation, as the Makefile does). One build:
# OpenBLAS picks its kernels for the running CPU. The rpath finds the wheel's library in this environment;
# ms_rope_attention/linear.py also loads it first by path, so a moved environment works as well.
try:
    import scipy_openblas32
except ImportError as missing:
    raise SystemExit("building ms_rope_attention needs scipy-openblas32 installed first "
                     "(pip install -r requirements.txt)") from missing
extensions.append(Extension(
    "ms_rope_attention._rfa_cpu_linear", sources=[f"{CSRC}/rfa_cpu_linear.cc"],
    depends=[f"{CSRC}/aot_abi.h", f"{CSRC}/rfa_problem.h"],
    include_dirs=[scipy_openblas32.get_include_dir()], library_dirs=[scipy_openblas32.get_lib_dir()],
    libraries=[scipy_openblas32.get_library()], runtime_library_dirs=[scipy_openblas32.get_lib_dir()],
    extra_compile_args=[c for c in COMMON if c != "-fopenmp"] + SANITIZE, extra_link_args=SANITIZE[:1],
    language="c++"))

# The Ascend C kernel (aclnn/op_kernel) compiled for the CPU against the AscendC emulation, for the
# tests only: the real kernel is built by CANN (ms_rope_attention/aclnn/build.sh).
ACLNN = "ms_rope_attention/aclnn"
extensions.append(Extension(
    "ms_rope_attention._rfa_ascend_emulated", sources=[f"{ACLNN}/emulator/rfa_ascend_emulated.cc"],
    include_dirs=[f"{ACLNN}/emulator", f"{ACLNN}/op_kernel", f"{ACLNN}/op_host", CSRC],
    depends=[f"{ACLNN}/emulator/kernel_operator.h", f"{ACLNN}/emulator/lib/matmul_intf.h",
             f"{ACLNN}/emulator/kernel_tiling/kernel_tiling.h",
             f"{ACLNN}/op_kernel/rotary_flash_attention.h", f"{ACLNN}/op_kernel/rotary_flash_attention.cpp",
             f"{ACLNN}/op_kernel/rotary_flash_attention_tiling.h", f"{ACLNN}/op_host/rotary_flash_attention_plan.h",
             f"{CSRC}/rfa_problem.h"],
    extra_compile_args=["-std=c++17", "-O2", "-pthread", "-fvisibility=hidden", "-Wall", "-Wextra",
                        "-D_GLIBCXX_USE_CXX11_ABI=0"] + SANITIZE,
    extra_link_args=["-pthread"] + SANITIZE[:1], language="c++"))

setup(
    name="ms_rope_attention",
    version="0.1.0",
    description="Rotary position embedding fused into FlashAttention for MindSpore (CPU kernel, Ascend C kernel)",
    packages=find_packages(include=["ms_rope_attention", "ms_rope_attention.*", "models", "models.*"]),
    package_data={"ms_rope_attention": ["op_info/*.yaml", "csrc/*.h", "csrc/*.cc"]},
    ext_modules=extensions,
    cmdclass={"build_ext": BuildKernels},
    python_requires=">=3.9",
    # Every runtime import of the package (tests/test_packaging.py checks it against the sources);
    # sentencepiece (tokenizer.model checkpoints) and torch (Meta .pth checkpoints) are optional.
    install_requires=["mindspore==2.10.0", "numpy>=1.25,<2", "pyyaml", "ml_dtypes>=0.4,<0.6", "safetensors",
                      "scipy-openblas32", "tokenizers", "tqdm"],
    extras_require={"test": ["pytest", "pytest-xdist"], "bench": ["matplotlib"], "sentencepiece": ["sentencepiece"],
                    "meta-pth": ["torch"],
                    # what users would pick instead, measured side by side by benchmarks/ttft.py
                    "peers": ["torch==2.13.0", "transformers>=5,<6"]},
)
