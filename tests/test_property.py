"""Seeded property test: random valid calls of the op against the float64 reference, in PyNative
(functional op) and GRAPH_MODE (Cell): every layout, both rotary modes, partial rotary, GQA/MQA,
causal and not, q_len <= kv_len, TND batches with empty and 1-token sequences, every dtype. 400 cases,
every fourth in GRAPH_MODE (each of those compiles a graph of its own: half of them took 102 s of the
suite on 2 busy cores), drawn in one seeded sequence and run in 4 chunks: ``make test`` runs the first,
``make test-all`` all 4; ``pytest tests/test_property.py --long`` runs 4000, every other one in
GRAPH_MODE."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

import ms_rope_attention as mra
from cases import Case
from conftest import round_to, to_numpy, to_tensor, tolerance
from reference import reference

CASES, LONG_CASES, CHUNKS = 400, 4000, 4


def random_case(rng):
    layout = rng.choice(["BNSD", "BSND", "BSH", "TND"])
    head_dim = int(rng.choice([8, 16, 32, 64]))
    kv_heads = int(rng.choice([1, 2, 3]))
    heads = kv_heads * int(rng.choice([1, 2, 4]))
    kv_len = int(rng.integers(1, 40))
    q_len = int(rng.integers(1, kv_len + 1))
    batches = int(rng.integers(1, 5))
    kv_lens = [int(x) for x in rng.integers(0, 30, batches)]
    kv_lens[0] = max(kv_lens[0], 1)
    q_lens = [int(rng.integers(0, k + 1)) if rng.random() < 0.8 else min(1, k) for k in kv_lens]
    rotary_dim = int(rng.choice([head_dim, head_dim // 2])) if head_dim >= 4 else head_dim
    rotary_dim -= rotary_dim % 2
    case = Case(layout=str(layout), batch=int(rng.integers(1, 3)), heads=heads, kv_heads=kv_heads, q_len=q_len,
                kv_len=kv_len, head_dim=head_dim, rotary_dim=None if rotary_dim == head_dim else rotary_dim,
                mode=int(rng.integers(0, 2)), causal=bool(rng.random() < 0.7), q_lens=q_lens, kv_lens=kv_lens,
                random_tables=bool(rng.random() < 0.5))
    return case, str(rng.choice(["float32", "float16", "bfloat16"]))


class Op(nn.Cell):
    def __init__(self, case):
        super().__init__()
        self.op = mra.RotaryFlashAttentionOp(with_softmax_lse=True, compute_dtype="float32", **case.kwargs)

    def construct(self, q, k, v, cos, sin, aq=None, ak=None):
        return self.op(q, k, v, cos, sin, aq, ak)


def check(case, dtype, inputs, graph):
    q, k, v, cos, sin, aq, ak = inputs
    q, k, v = (round_to(t, dtype) for t in (q, k, v))
    ro, rl, _ = reference(q, k, v, cos, sin, case.heads, case.layout, case.mode, case.rotary_dim, None, case.causal,
                          aq, ak)
    tensors = [to_tensor(t, dtype) for t in (q, k, v)] + [Tensor(t.astype(np.float32)) for t in (cos, sin)]
    offsets = [Tensor(np.array(aq, np.int64)), Tensor(np.array(ak, np.int64))] if aq is not None else []
    if graph:
        out, lse, _ = Op(case)(*tensors, *offsets)
    else:
        out, lse = mra.rotary_flash_attention(*tensors, actual_seq_qlen=aq, actual_seq_kvlen=ak,
                                              return_softmax_lse=True, compute_dtype="float32", **case.kwargs)
    assert np.abs(to_numpy(out) - ro).max(initial=0) <= tolerance(dtype, ro), (case, dtype)
    finite = np.isfinite(rl)
    assert (np.isfinite(lse.asnumpy()) == finite).all(), (case, dtype)
    assert np.abs(lse.asnumpy()[finite] - rl[finite]).max(initial=0) <= 1e-3, (case, dtype)


@pytest.mark.starts_first
@pytest.mark.parametrize("chunk", [0] + [pytest.param(c, marks=pytest.mark.integration) for c in range(1, CHUNKS)])
def test_random_valid_calls_match_the_reference(chunk, long_run):
    """The chunk's quarter of the one seeded sequence; the cases before it are drawn, not run."""
    rng = np.random.default_rng(2026)
    total = LONG_CASES if long_run else CASES
    for i in range((chunk + 1) * total // CHUNKS):
        case, dtype = random_case(rng)
        inputs = case.make(rng)
        if i >= chunk * total // CHUNKS:
            graph = i % (2 if long_run else 4) == 1
            ms.set_context(mode=ms.GRAPH_MODE if graph else ms.PYNATIVE_MODE)
            check(case, dtype, inputs, graph)


def test_random_lengths_one_graph():
    """One GRAPH_MODE Cell with dynamic batch and sequence dimensions over random lengths: one compile."""
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(7)
    case = Case(layout="BSND", heads=4, kv_heads=2, head_dim=16)
    cell = Op(case)
    cell.set_inputs(Tensor(shape=[None, None, 4, 16], dtype=ms.float32), Tensor(shape=[None, None, 2, 16],
                    dtype=ms.float32), Tensor(shape=[None, None, 2, 16], dtype=ms.float32),
                    Tensor(shape=[None, 16], dtype=ms.float32), Tensor(shape=[None, 16], dtype=ms.float32))
    for _ in range(8):
        kv_len = int(rng.integers(1, 50))
        case.batch, case.kv_len, case.q_len = int(rng.integers(1, 4)), kv_len, int(rng.integers(1, kv_len + 1))
        q, k, v, cos, sin, _, _ = case.make(rng)
        out = cell(*(Tensor(t.astype(np.float32)) for t in (q, k, v, cos, sin)))[0].asnumpy()
        expected = reference(q, k, v, cos, sin, input_layout="BSND")[0]
        assert np.abs(out - expected).max() <= 1e-5
    assert len(cell.compile_cache) == 1
