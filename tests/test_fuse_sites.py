"""fuse() lists every attention-like Cell as a site (issue 41): a Cell whose own code computes a
softmax and a product of tensors, or calls a known attention op, is reported fused or ``not fused:
<reason>`` whatever its class is called; a model with no attention gets a report that says so; and
``strict=True`` raises for any such site not fused. The model is a small Llama written the way people
port Hugging Face's eager code, with class names no family knows."""
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from ms_rope_attention import FuseError, fuse
from ms_rope_attention.fusion import attention_like

HIDDEN, HEADS, KV_HEADS, LENGTH, VOCAB = 32, 4, 2, 9, 50
HEAD_DIM = HIDDEN // HEADS


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return ops.cat((-x2, x1), axis=-1)


def apply_rotary(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].broadcast_to((b, h, n_rep, s, d)).reshape(b, h * n_rep, s, d)


class Rotary(nn.Cell):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.inv_freq = Tensor(1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)))

    def construct(self, position_ids):
        freqs = position_ids.astype(ms.float32).unsqueeze(-1) * self.inv_freq
        emb = ops.cat((freqs, freqs), axis=-1)
        return emb.cos(), emb.sin()


class SelfAttn(nn.Cell):
    """HF-eager port: Dense projections, view + swapaxes, a module-level apply_rotary on rotate_half,
    repeat_kv for GQA, scores * scaling + mask, softmax in float32, matmul with v."""

    def __init__(self):
        super().__init__()
        self.scaling = HEAD_DIM ** -0.5
        self.q_proj = nn.Dense(HIDDEN, HEADS * HEAD_DIM, has_bias=False)
        self.k_proj = nn.Dense(HIDDEN, KV_HEADS * HEAD_DIM, has_bias=False)
        self.v_proj = nn.Dense(HIDDEN, KV_HEADS * HEAD_DIM, has_bias=False)
        self.o_proj = nn.Dense(HEADS * HEAD_DIM, HIDDEN, has_bias=False)

    def construct(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, HEADS, HEAD_DIM).swapaxes(1, 2)
        k = self.k_proj(x).view(b, s, KV_HEADS, HEAD_DIM).swapaxes(1, 2)
        v = self.v_proj(x).view(b, s, KV_HEADS, HEAD_DIM).swapaxes(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        k, v = repeat_kv(k, HEADS // KV_HEADS), repeat_kv(v, HEADS // KV_HEADS)
        w = ops.matmul(q, k.swapaxes(2, 3)) * self.scaling + mask
        w = ops.softmax(w.astype(ms.float32), axis=-1).astype(q.dtype)
        out = ops.matmul(w, v)
        return self.o_proj(out.swapaxes(1, 2).reshape(b, s, -1))


class QOnlyRope(SelfAttn):
    """Near-miss: RoPE on q only."""

    def construct(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, HEADS, HEAD_DIM).swapaxes(1, 2)
        k = repeat_kv(self.k_proj(x).view(b, s, KV_HEADS, HEAD_DIM).swapaxes(1, 2), HEADS // KV_HEADS)
        v = repeat_kv(self.v_proj(x).view(b, s, KV_HEADS, HEAD_DIM).swapaxes(1, 2), HEADS // KV_HEADS)
        q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
        w = ops.softmax(ops.matmul(q, k.swapaxes(2, 3)) / math.sqrt(HEAD_DIM) + mask, axis=-1)
        return self.o_proj(ops.matmul(w, v).swapaxes(1, 2).reshape(b, s, -1))


class Block(nn.Cell):
    def __init__(self, attention):
        super().__init__()
        self.attn = attention()
        self.mlp = nn.SequentialCell(nn.Dense(HIDDEN, 2 * HIDDEN), nn.ReLU(), nn.Dense(2 * HIDDEN, HIDDEN))

    def construct(self, x, cos, sin, mask):
        x = x + self.attn(x, cos, sin, mask)
        return x + self.mlp(x)


class Ported(nn.Cell):
    def __init__(self, attention=SelfAttn, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.rotary = Rotary(HEAD_DIM)
        self.blocks = nn.CellList([Block(attention) for _ in range(layers)])
        self.head = nn.Dense(HIDDEN, VOCAB, has_bias=False)

    def construct(self, ids):
        s = ids.shape[1]
        cos, sin = self.rotary(ops.arange(s).reshape(1, s))
        mask = ops.triu(ops.full((s, s), -1e9, dtype=ms.float32), diagonal=1)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.head(x)


class MlpOnly(nn.Cell):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mlp = nn.SequentialCell(nn.Dense(HIDDEN, HIDDEN), nn.Softmax())

    def construct(self, ids):
        return self.mlp(self.embed(ids))


def ids():
    return Tensor(np.random.default_rng(0).integers(0, VOCAB, (2, LENGTH)).astype(np.int32))


@pytest.mark.parametrize("attention", [SelfAttn, QOnlyRope])
def test_every_attention_like_cell_is_a_site_with_its_reason(attention):
    ms.set_seed(0)
    model = Ported(attention)
    want = model(ids()).asnumpy()
    report = fuse(model)
    assert [s.name for s in report] == ["blocks.0.attn", "blocks.1.attn"], str(report)
    for site in report:
        assert site.status == "not fused" and site.reason.startswith("no fuse family recognises"), str(report)
        assert "hand-written style" in site.reason
    assert "2 not fused" in str(report) and "blocks.1.attn" in str(report)
    np.testing.assert_array_equal(model(ids()).asnumpy(), want)
    with pytest.raises(FuseError, match="2 site"):
        fuse(model, strict=True)


def test_a_model_without_attention_says_so():
    report = fuse(MlpOnly())
    assert len(report) == 0 and "no attention found" in str(report) and not report.all_fused
    with pytest.raises(FuseError, match="no attention site found"):
        fuse(MlpOnly(), strict=True)


def _scores(q, k):
    return ops.matmul(q, k.swapaxes(-1, -2))


class ThroughHelpers(nn.Cell):
    def construct(self, q, k, v):
        return self._weights(q, k) @ v

    def _weights(self, q, k):
        return ops.softmax(_scores(q, k), axis=-1)


class KnownOp(nn.Cell):
    def construct(self, q, k, v):
        return ops.flash_attention_score(q, k, v, 4, input_layout="BNSD")


class Router(nn.Cell):  # a softmax without a product of tensors: not attention
    def __init__(self):
        super().__init__()
        self.gate = nn.Dense(4, 2)

    def construct(self, x):
        return ops.softmax(self.gate(x), axis=-1)


@pytest.mark.parametrize("cell, computes", [(ThroughHelpers, True), (KnownOp, True), (SelfAttn, True),
                                            (Router, False), (Block, False), (Ported, False)])
def test_attention_is_recognised_by_what_the_code_calls(cell, computes):
    assert attention_like.computes_attention(cell) is computes
