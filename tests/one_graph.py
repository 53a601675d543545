"""Several cells' calls compiled as one GRAPH_MODE graph: a graph compile is mostly fixed cost (an unfused op
or a small model, seconds each on 2 busy cores), so a test of many cases compiles once (docs/testing.md)."""
import numpy as np
from mindspore import nn


class InOneGraph(nn.Cell):
    """``nets[i]`` called on its ``arities[i]`` arguments, taken in order from the call's; their outputs as a tuple."""

    def __init__(self, nets, arities):
        super().__init__()
        self.nets = nn.CellList(list(nets))
        self.bounds = tuple(int(b) for b in np.cumsum([0, *arities]))

    def construct(self, *args):
        outs = ()
        for i in range(len(self.nets)):
            outs += (self.nets[i](*args[self.bounds[i]:self.bounds[i + 1]]),)
        return outs
