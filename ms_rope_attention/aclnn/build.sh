#!/usr/bin/env bash
# Builds the CANN custom-op package of RotaryFlashAttention and its backward RotaryFlashAttentionGrad
# (Atlas A2 / A3) and optionally installs it.
#
#   source <CANN>/set_env.sh            # CANN toolkit with Ascend C (ASCEND_HOME_PATH set)
#   ms_rope_attention/aclnn/build.sh                       # build only
#   ms_rope_attention/aclnn/build.sh --install-path DIR    # build, install to DIR/vendors/rope_attention
#
# The sources are staged with the CANN-free headers they share with the rest of the project
# (rfa_problem.h from csrc/, the tiling headers from op_kernel/), then compiled by MindSpore's
# custom-op compiler (msopgen project template, CMake, Ascend C compiler). The template compiles every
# op_host/*.cpp into one set of libraries and, for each op of the OpDefs, op_kernel/<op_file>.cpp with
# the entry <op_file>, op_file being the op's type in snake case (rotary_flash_attention,
# rotary_flash_attention_grad).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
install_path=""
if [[ "${1:-}" == "--install-path" ]]; then install_path=$2; mkdir -p "$install_path"; fi  # the compiler needs it to exist
: "${ASCEND_HOME_PATH:?source <CANN>/set_env.sh first (ASCEND_HOME_PATH is not set)}"
python=${PYTHON:-python3}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/op_host" "$stage/op_kernel"
cp "$here"/op_host/*.cpp "$here"/op_host/*.h "$here/../csrc/rfa_problem.h" "$here"/op_kernel/*_tiling.h \
   "$stage/op_host/"
cp "$here"/op_kernel/*.cpp "$here"/op_kernel/*.h "$stage/op_kernel/"
# The OpDefs must match the contract: regenerate them rather than trust stale copies.
"$python" -m ms_rope_attention.op_info --opdef > "$stage/op_host/rotary_flash_attention_opdef.h"
"$python" -m ms_rope_attention.op_info --opdef --backward > "$stage/op_host/rotary_flash_attention_grad_opdef.h"
compiler=$("$python" -c "import mindspore, os; print(os.path.join(os.path.dirname(mindspore.__file__), 'lib/plugin/ascend/custom_compiler/setup.py'))")
args=(-o "$stage/op_host" -k "$stage/op_kernel" --soc_version "ascend910b;ascend910_93"
      --ascend_cann_package_path "$ASCEND_HOME_PATH" --vendor_name rope_attention)
if [[ -n "$install_path" ]]; then args+=(-i --install_path "$install_path"); fi
"$python" "$compiler" "${args[@]}"
echo "built. To use it: export ASCEND_CUSTOM_OPP_PATH=${install_path:-<install path>}/vendors/rope_attention:\${ASCEND_CUSTOM_OPP_PATH:-}"
