#!/usr/bin/env bash
# End-to-end check on an Ascend machine: build and install the op package, accuracy of the fused op
# on the NPU against the unfused path and the float64 reference, each Ascend backward (FlashAttention,
# unfused, and the fused backward kernel RotaryFlashAttentionGrad, so far run on the CPU emulation
# only) against the CPU kernel's gradients, the op sharded in a semi-auto parallel graph on 2 NPUs
# against one device, the backwards' time and memory side by side, then the TTFT benchmark.
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
# Semi-auto parallel (self_define_shard layouts, dp=2 and tp=2): msrun --worker_num=2
# --local_worker_num=2 --join=True through the project's launcher, which prints each rank's log and
# exits with msrun's status (non-zero when a rank prints FAIL).
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$python" -m ms_rope_attention.distributed.launch --workers 2 \
    tests/ascend/semi_auto_parallel.py
# Training: each backward (RFA_ASCEND_BACKWARD=flash_attention_score, unfused, kernel) against
# ops.rotary_position_embedding + ops.flash_attention_score, forward + backward time and peak device
# memory at S = 2048..16384, and the tiny Llama trained 20 steps with each.
"$python" benchmarks/ascend_backward.py --out benchmarks/results/ascend
"$python" benchmarks/ttft.py --device Ascend --dtype float16 --out benchmarks/results/ascend
