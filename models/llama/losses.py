"""The training losses of the Llama: ``LlamaForTraining`` (one process, or data/tensor parallel:
the mean next-token cross-entropy) and ``ContextParallelTraining`` (one rank's part of a
context-parallel batch).

Context parallelism for training: every rank of a context-parallel group holds the load-balanced
part (chunks r and 2W-1-r) of every sequence, runs the model on it (only attention talks to the
other ranks), and scores its own tokens. The next-token targets are shifted over the *whole*
sequence before it is cut (a chunk's last target is the next chunk's first token, which another rank
may hold), and each rank's loss is its tokens' share of the mean over all ranks' tokens, so the
ranks' losses and weight gradients add up to those of one process on the whole batch.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from ms_rope_attention.distributed import load_balanced_chunks

from .model import LlamaForCausalLM

IGNORE_INDEX = -100  # labels that take no part in the loss (as in Hugging Face)


class LlamaForTraining(nn.Cell):
    """The training forward of a ``LlamaForCausalLM`` (built with ``logits="all"``): mean next-token
    cross-entropy in float32, no KV cache.

    ``construct(input_ids, labels, actual_seq_qlen=None)``: ``labels`` are aligned with
    ``input_ids`` (Hugging Face's convention: the logits at token i are scored against labels[i + 1]);
    ``IGNORE_INDEX`` marks labels that take no part. For a packed TND batch (input_ids (T,), cumulative
    ends ``actual_seq_qlen``) the first label of every sequence must be ``IGNORE_INDEX``, so no sequence
    is asked to predict the next one's start.
    """

    def __init__(self, lm: LlamaForCausalLM):
        super().__init__(auto_prefix=False)  # parameters keep their Hugging Face names
        self.lm = lm
        self.vocab_size = lm.vocab_size
        self.packed = lm.layout == "TND"
        self.ignore_index = IGNORE_INDEX  # an attribute: amp O1's rewrite drops module constants

    def construct(self, input_ids, labels, actual_seq_qlen=None):
        logits = self.lm(input_ids, actual_seq_qlen, actual_seq_qlen)
        if self.packed:
            logits, labels = logits[:-1], labels[1:]
        else:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return ops.cross_entropy(logits.reshape(-1, self.vocab_size), labels.reshape(-1).astype(ms.int32),
                                 ignore_index=self.ignore_index)


def shifted_targets(labels: np.ndarray) -> np.ndarray:
    """targets[..., i] = labels[..., i + 1], the last IGNORE_INDEX: what the logits at token i are
    scored against (Hugging Face's convention), before the sequence is cut."""
    labels = np.asarray(labels)
    return np.concatenate([labels[..., 1:], np.full(labels.shape[:-1] + (1,), IGNORE_INDEX, labels.dtype)], -1)


def context_parallel_batch(input_ids: np.ndarray, labels: np.ndarray, rank: int, size: int):
    """(this rank's input_ids, its targets, the number of scored tokens over every rank) of a (B, S) batch."""
    targets = shifted_targets(labels)
    return (load_balanced_chunks(np.asarray(input_ids), rank, size), load_balanced_chunks(targets, rank, size),
            int((targets != IGNORE_INDEX).sum()))


class ContextParallelTraining(nn.Cell):
    """The loss of one rank's part: sum of its tokens' cross-entropies over ``scored`` (the scored
    tokens of every rank). ``construct(input_ids, targets, scored)``; the sum over ranks of the loss
    and of the weight gradients are the whole batch's mean cross-entropy and its gradients."""

    def __init__(self, lm: LlamaForCausalLM):
        super().__init__(auto_prefix=False)  # parameters keep their Hugging Face names
        self.lm = lm
        self.vocab_size = lm.vocab_size
        self.ignore_index = IGNORE_INDEX

    def construct(self, input_ids, targets, scored):
        logits = self.lm(input_ids)
        total = ops.cross_entropy(logits.reshape(-1, self.vocab_size), targets.reshape(-1).astype(ms.int32),
                                  ignore_index=self.ignore_index, reduction="sum")
        return total / scored.astype(ms.float32)
