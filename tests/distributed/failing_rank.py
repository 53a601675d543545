"""Run by tests/test_distributed.py under msrun: rank 1 fails while rank 0 waits in a collective."""
import mindspore as ms
import numpy as np
from mindspore.communication import get_rank, init

ms.set_device("CPU")
init()
if get_rank() == 1:
    raise RuntimeError("rank 1 fails on purpose")
print(ms.ops.AllReduce()(ms.Tensor(np.ones(4, np.float32))))
