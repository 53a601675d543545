"""The Cell and the functional op in both modes, forward and backward, with dynamic sequence lengths:
what tests/test_quiet.py runs in a fresh process and reads the output of."""
import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

import ms_rope_attention as mra

ms.set_device("CPU")
HEADS, KV_HEADS, DIM = 4, 2, 16


class Loss(nn.Cell):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def construct(self, q, k, v):
        return self.attn(q, k, v).sum()


class Functional(nn.Cell):
    """The functional op inside a Cell, TND with offsets (variable lengths)."""

    def __init__(self):
        super().__init__()
        self.cos, self.sin = mra.shared_rope_tables(DIM, 256)

    def construct(self, q, k, v, cu_q, cu_kv):
        return mra.rotary_flash_attention(q, k, v, self.cos, self.sin, HEADS, input_layout="TND",
                                          actual_seq_qlen=cu_q, actual_seq_kvlen=cu_kv)


rng = np.random.default_rng(0)
for mode in (ms.GRAPH_MODE, ms.PYNATIVE_MODE):
    ms.set_context(mode=mode)
    attn = mra.RotaryFlashAttention(HEADS, DIM, input_layout="BSND", max_position_embeddings=256)
    grad = ms.grad(Loss(attn), grad_position=(0, 1, 2))
    varlen = Functional()
    q_dyn = Tensor(shape=[1, None, HEADS, DIM], dtype=ms.float32)
    kv_dyn = Tensor(shape=[1, None, KV_HEADS, DIM], dtype=ms.float32)
    attn.set_inputs(q_dyn, kv_dyn, kv_dyn)
    varlen.set_inputs(Tensor(shape=[None, HEADS, DIM], dtype=ms.float32),
                      Tensor(shape=[None, KV_HEADS, DIM], dtype=ms.float32),
                      Tensor(shape=[None, KV_HEADS, DIM], dtype=ms.float32),
                      Tensor(shape=[None], dtype=ms.int64), Tensor(shape=[None], dtype=ms.int64))
    for length in (7, 33):
        q = Tensor(rng.standard_normal((1, length, HEADS, DIM)).astype(np.float32))
        k, v = (Tensor(rng.standard_normal((1, length, KV_HEADS, DIM)).astype(np.float32)) for _ in range(2))
        attn(q, k, v).asnumpy()
        [g.asnumpy() for g in grad(q, k, v)]
        ends = Tensor(np.array([length, 2 * length + 1], np.int64))
        tq = Tensor(rng.standard_normal((2 * length + 1, HEADS, DIM)).astype(np.float32))
        tk, tv = (Tensor(rng.standard_normal((2 * length + 1, KV_HEADS, DIM)).astype(np.float32)) for _ in range(2))
        varlen(tq, tk, tv, ends, ends).asnumpy()
print("calls done")
