"""Megatron's two communication points of a tensor-parallel block, with the gradients they need.

A column-parallel projection (q/k/v, gate/up: each rank holds some output features) reads the whole
activation; a row-parallel one (o, down: each rank holds some input features) leaves a partial sum.

- ``CopyToTensorParallel`` ("f"): identity forward; the backward sums the activation's gradient over
  the ranks (each rank's column shard contributed a part of it).
- ``ReduceFromTensorParallel`` ("g"): the partial sums added over the ranks in the forward; identity
  backward (every rank already holds the whole gradient).
- ``GatherFromTensorParallel``: the ranks' slices of the last axis concatenated (vocab-parallel
  logits); the backward takes the rank's slice of the gradient (the loss after it is the same on
  every rank, so nothing is summed).

A plain ``ops.AllReduce`` in place of "g" differentiates to another AllReduce: every rank's
gradient comes back summed over the ranks, i.e. multiplied by the degree (measured on 2 CPU ranks:
gradients off by about 1e1).
"""
from __future__ import annotations

from mindspore import ops

from .collectives import GroupCollective


class CopyToTensorParallel(GroupCollective):
    """Megatron's "f": identity forward, gradient summed over the ranks."""

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        return (self.all_reduce(dout),)


class ReduceFromTensorParallel(GroupCollective):
    """Megatron's "g": partial sums added over the ranks, gradient passed through."""

    def construct(self, x):
        return self.all_reduce(x)

    def bprop(self, x, out, dout):
        return (dout,)


class GatherFromTensorParallel(GroupCollective):
    """The ranks' slices of the last axis, concatenated in rank order; gradient: the rank's slice."""

    def construct(self, x):
        # The gather concatenates dim 0: the last axis goes first and comes back.
        return ops.moveaxis(self.all_gather(ops.moveaxis(x, -1, 0)), 0, -1)

    def bprop(self, x, out, dout):
        width = x.shape[-1]
        return (dout[..., self.rank * width:(self.rank + 1) * width],)
