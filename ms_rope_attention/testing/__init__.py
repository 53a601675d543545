"""Test instruments: the kernels' C entries called directly on numpy arrays (``cpu_direct``) and the
Ascend C kernel on its CPU emulation (``ascend_emulated``). Used by the tests, the sanitizer run and
the benchmarks; nothing in the op's own path imports them."""
