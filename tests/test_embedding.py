"""The half-table embedding lookup (ms_rope_attention/embedding.py, csrc/rfa_cpu_embedding.cc):
rows equal the table's, converted to float32 exactly (bit for bit, NaN and infinities included),
on every build this CPU runs; out-of-range ids and bad shapes refused by name; the op in both
modes; the table's gradient."""
import re

import ml_dtypes
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from ms_rope_attention import embedding, linear
from ms_rope_attention.cpu_runtime import built_libraries, usable_isas

ISAS = [isa for isa in usable_isas() if isa in built_libraries(linear.STEM)]
TABLE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("table_dtype", TABLE_DTYPES)
@pytest.mark.parametrize("ids_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("ids_shape, hidden", [((1,), 1), ((7,), 40), ((2, 3), 72), ((3, 1, 5), 4099), ((0,), 8)])
def test_rows_equal_the_table_exactly(isa, table_dtype, ids_dtype, ids_shape, hidden, rng):
    table = rng.standard_normal((11, hidden)).astype(np.float32).astype(TABLE_DTYPES[table_dtype])
    table.reshape(-1)[:3] = [np.nan, np.inf, -np.inf]
    ids = rng.integers(0, 11, ids_shape).astype(ids_dtype)
    got = embedding.lookup(ids, table, isa=isa)
    np.testing.assert_array_equal(got, table.astype(np.float32)[ids])


@pytest.mark.parametrize("ids, table, out_shape, message", [
    (np.array([3, 11], np.int32), np.zeros((11, 4), np.float16), None,
     "ids: expected values in [0, 11), got 11 at flat index 1"),
    (np.array([[0], [-1]], np.int64), np.zeros((11, 4), np.float16), None,
     "ids: expected values in [0, 11), got -1 at flat index 1"),
    (np.array([1.0], np.float32), np.zeros((11, 4), np.float16), (1, 4), "ids: expected int32 or int64, got float32"),
    (np.array([1], np.int32), np.zeros((11, 4), np.float64), None,
     "table: expected float32, float16 or bfloat16, got float64"),
    (np.array([1], np.int32), np.zeros((44,), np.float16), (1, 4), "table: expected 2 dimensions (vocab, hidden)"),
    (np.array([1, 2], np.int32), np.zeros((11, 4), np.float16), (2, 5), "y: expected shape ids.shape + (hidden,)"),
])
def test_refuses_bad_input_by_name(ids, table, out_shape, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        embedding.lookup(ids, table, out_shape)


class Lookup(nn.Cell):
    def __init__(self, table):
        super().__init__()
        self.table = ms.Parameter(Tensor(table), name="table")
        self.op = embedding.embedding_op()

    def construct(self, ids):
        return self.op(ids, self.table)


@pytest.mark.parametrize("table_dtype", ["float16", "bfloat16"])
def test_op_in_both_modes_and_its_gradient(mode, table_dtype, rng):
    table = rng.standard_normal((9, 24)).astype(np.float32).astype(TABLE_DTYPES[table_dtype])
    net = Lookup(table)
    if mode == "graph":
        net.set_inputs(Tensor(shape=[None], dtype=ms.int32))
    for n in (1, 6):
        ids = rng.integers(0, 9, n).astype(np.int32)
        np.testing.assert_array_equal(net(Tensor(ids)).asnumpy(), table.astype(np.float32)[ids])
    ids = np.array([2, 5, 2], np.int32)
    dy = rng.standard_normal((3, 24)).astype(np.float32)
    (dtable,) = ops.GradOperation(get_by_list=True, sens_param=True)(net, net.trainable_params())(Tensor(ids),
                                                                                                 Tensor(dy))
    expected = np.zeros((9, 24))
    np.add.at(expected, ids, dy)
    assert str(dtable.dtype).lower() == table_dtype
    np.testing.assert_allclose(dtable.astype(ms.float32).asnumpy(), expected, rtol=1e-2, atol=1e-2)
