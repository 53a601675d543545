"""The attention variants of a step over a KV cache, each a named class: how the step's new tokens
reach the cache and what they attend over. ``LlamaAttention`` has one method per variant and picks
it by the view's class, a compile-time constant; an engine's graph Cell builds its view.

A view is a plain tuple ``(its class, every layer's keys, every layer's values, its fields...)``,
built by ``<Variant>.build`` and read by ``<Variant>.<field>(view)``: no other file indexes it.
Why a tuple: in MindSpore 2.10 a NamedTuple, a dataclass or an ``ms.jit_class`` instance made
inside a jit construct from the step's tensors is not a graph value (GRAPH_MODE and ``ms.jit`` in
PyNative alike). The first two go through the JIT fallback (refused under
``jit_syntax_level=STRICT``; in LAX their tensors came back float64 and ``ScatterUpdate`` into the
cache refused them), the third needs constant arguments. A dataclass of tensors does pass as a
*top-level* jit input, but the views hold the cache's Parameters and are made inside the graph.
A tuple holding a class object, read by these staticmethods, compiles natively, STRICT included.

Chunked prefill needs no class of its own: ``PagedPrefill`` takes any number of new tokens per
sequence over a cached prefix and ``PagedDecode`` 1..16, so a server's mixed step (prompt chunks and
one decode token per running sequence, packed) is a view of either (the engine picks by its size).
"""
from __future__ import annotations

import inspect


def _field(index: int):
    def read(view):
        return view[index]
    return read


class CacheView:
    """A variant: ``build``'s parameters name its fields, in the tuple's order, and each field
    gets a reader of its own. ``last_token_logits``: the step's logits are wanted at each
    sequence's last new token only (a prompt's), not at every token (a decode step's)."""

    last_token_logits = False
    FIELDS: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.FIELDS = tuple(inspect.signature(cls.build).parameters)
        for index, name in enumerate(cls.FIELDS, 1):
            setattr(cls, name, staticmethod(_field(index)))

    @staticmethod
    def build(*fields):
        raise NotImplementedError

    keys, values = staticmethod(_field(1)), staticmethod(_field(2))  # every variant's first two fields

    @staticmethod
    def variant(view):
        """The view's class: what ``LlamaAttention`` dispatches on."""
        return view[0]

    @staticmethod
    def layer(view, i):
        """The view of layer ``i``: its own keys and values, the step's fields unchanged."""
        return (view[0], view[1][i], view[2][i]) + view[3:]


class ContiguousPrefill(CacheView):
    """Whole prompts (packed TND, ending at ``actual_seq_qlen``) into a ``KVCache``: the fused op
    rotates Q and K and returns the rotated keys, written with the values at ``rows``."""

    last_token_logits = True

    @staticmethod
    def build(keys, values, rows):
        return (ContiguousPrefill, keys, values, rows)


class ContiguousDecode(CacheView):
    """1..16 new tokens per cached sequence: their keys rotated alone at ``positions``, written at
    ``rows``, and the op attends over the whole cache with ``key_rotated`` (``KVCache.step_offsets``)."""

    @staticmethod
    def build(keys, values, rows, positions):
        return (ContiguousDecode, keys, values, rows, positions)


class PagedPrefill(CacheView):
    """New tokens after a cached prefix in a ``PagedKVCache`` (a block a copy-on-write replaces is
    copied before the step: ``PagedKVCache.copy_blocks``): the new keys rotated and written with the
    values at ``slots``, and the fused op (``key_rotated``) attends over each sequence's keys read at
    ``context`` (TND order) among the rows of the step's ``blocks`` (each sequence's, in order)."""

    last_token_logits = True

    @staticmethod
    def build(keys, values, slots, positions, blocks, context):
        return (PagedPrefill, keys, values, slots, positions, blocks, context)


class PagedDecode(CacheView):
    """1..16 new tokens per sequence (``q_seq_lens``), written at ``slots``; ``rotary_paged_attention``
    reads the blocks in place through ``block_tables``."""

    @staticmethod
    def build(keys, values, slots, positions, block_tables, context_lens, q_seq_lens):
        return (PagedDecode, keys, values, slots, positions, block_tables, context_lens, q_seq_lens)
