#!/usr/bin/env bash
# End-to-end check on an Ascend machine: build and install the op package, accuracy of the fused op
# on the NPU against the unfused path and the float64 reference, then the TTFT benchmark.
#   ms_rope_attention/aclnn/verify_on_ascend.sh INSTALL_DIR
set -euo pipefail
install_dir=${1:?usage: verify_on_ascend.sh INSTALL_DIR}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
python=${PYTHON:-python3}
mkdir -p "$install_dir"
PYTHON=$python ms_rope_attention/aclnn/build.sh --install-path "$install_dir"
export ASCEND_CUSTOM_OPP_PATH="$install_dir/vendors/rope_attention:${ASCEND_CUSTOM_OPP_PATH:-}"
RFA_TEST_DEVICE=Ascend "$python" -m pytest -q tests/test_ascend_device.py
"$python" benchmarks/ttft.py --device Ascend --dtype float16 --out benchmarks/results/ascend
