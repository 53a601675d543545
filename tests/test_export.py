"""A graph holding the op exports to MindIR with a dynamic sequence length, and the MindIR loads
and runs in a fresh process (its output and dtypes come from the kernel's C++ InferShape and
InferType: no Python callable is left in the graph)."""
import subprocess
import sys

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

import ms_rope_attention as mra

LOAD = """
import sys, numpy as np, mindspore as ms
from mindspore import Tensor, nn
ms.set_device("CPU"); ms.set_context(mode=ms.GRAPH_MODE)
net = nn.GraphCell(ms.load(sys.argv[1]))
for length in (9, 5, 17):
    rng = np.random.default_rng(length)
    q, k, v = (Tensor(rng.standard_normal((1, length, h, 16)).astype(np.float16)) for h in (4, 2, 2))
    out = net(q, k, v)
    assert out.dtype == ms.float16 and out.shape == (1, length, 4, 16), (out.dtype, out.shape)
    np.save(f"{sys.argv[2]}_{length}.npy", out.astype(ms.float32).asnumpy())
print("loaded")
"""


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.attn = mra.RotaryFlashAttention(4, 16, input_layout="BSND", max_position_embeddings=64)

    def construct(self, q, k, v):
        return self.attn(q, k, v)


def test_mindir_round_trip_with_dynamic_sequence_length(tmp_path):
    ms.set_context(mode=ms.GRAPH_MODE)
    net = Net()
    dynamic = [Tensor(shape=[1, None, heads, 16], dtype=ms.float16) for heads in (4, 2, 2)]
    net.set_inputs(*dynamic)
    ms.export(net, *dynamic, file_name=str(tmp_path / "rfa"), file_format="MINDIR")
    result = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "rfa.mindir"), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "loaded" in result.stdout, result.stderr[-3000:]
    for length in (9, 5, 17):
        rng = np.random.default_rng(length)
        q, k, v = (Tensor(rng.standard_normal((1, length, h, 16)).astype(np.float16)) for h in (4, 2, 2))
        expected = net(q, k, v).astype(ms.float32).asnumpy()
        np.testing.assert_array_equal(np.load(tmp_path / f"out_{length}.npy"), expected)
