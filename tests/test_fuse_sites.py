"""fuse() on attention written the way people port it (issue 41): every attention-like Cell (its own
code computes a softmax and a product of tensors, or calls a known attention op) is a site, fused or
``not fused: <reason>`` whatever its class is called; a model with no attention gets a report that
says so; ``strict=True`` raises for any site not fused. A zoo of spellings of the same attention is
fused in GRAPH_MODE and PyNative (outputs within 1e-4, and not bit-identical: the fused op ran); its
near-misses are reported with their reason and left bit-identical."""
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from ms_rope_attention import FuseError, fuse
from ms_rope_attention.fusion import attention_like
from ms_rope_attention.fusion.family import eager
from ms_rope_attention.fusion.handwritten import runtime
from one_graph import InOneGraph

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
        self.head_dim = HEAD_DIM
        self.scaling = HEAD_DIM ** -0.5
        self.attention_dropout = 0.0
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

    def heads(self, x):
        """(q, k, v) in BNSD, for the variants below (their spelling is what follows)."""
        b, s, _ = x.shape
        return (self.q_proj(x).view(b, s, HEADS, HEAD_DIM).swapaxes(1, 2),
                self.k_proj(x).view(b, s, KV_HEADS, HEAD_DIM).swapaxes(1, 2),
                self.v_proj(x).view(b, s, KV_HEADS, HEAD_DIM).swapaxes(1, 2))

    def merge(self, out):
        b, _, s, _ = out.shape
        return self.o_proj(out.swapaxes(1, 2).reshape(b, s, -1))


class PackedQKV(SelfAttn):
    """One qkv projection split three ways; the scale on q after RoPE; ``@``; transpose(0, 1, 3, 2);
    the scores scaled, masked and cast in statements of their own; dropout on the probabilities."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Dense(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, has_bias=False)
        self.dropout = nn.Dropout(p=0.5)

    def construct(self, x, cos, sin, mask):
        b, s, _ = x.shape
        qkv = self.qkv(x)
        q_end, k_end = HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM
        q = qkv[..., :q_end].reshape(b, s, HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
        k = qkv[..., q_end:k_end].reshape(b, s, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
        v = qkv[..., k_end:].reshape(b, s, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
        q, k = apply_rotary(q, k, cos, sin)
        k = repeat_kv(k, HEADS // KV_HEADS)
        v = repeat_kv(v, HEADS // KV_HEADS)
        q = q * self.scaling
        attn = q @ k.transpose(0, 1, 3, 2)
        attn = attn + mask
        attn = attn.astype(ms.float32)
        attn = ops.softmax(attn, -1)
        attn = self.dropout(attn)
        out = attn @ v
        return self.o_proj(out.swapaxes(1, 2).reshape(b, s, -1))


def repeat_interleaved(x, n_rep):
    return ops.repeat_interleave(x, n_rep, axis=1)


class ScaleFirst(SelfAttn):
    """The scale folded into q before RoPE (so none on the scores), ops.swapaxes, ops.bmm-free
    matmul with the mask first, repeat_kv by repeat_interleave, mint-style softmax keywords."""

    def construct(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = ops.swapaxes((self.q_proj(x) * self.scaling).view(b, s, HEADS, HEAD_DIM), 1, 2)
        k = ops.swapaxes(self.k_proj(x).view(b, s, KV_HEADS, HEAD_DIM), 1, 2)
        v = ops.swapaxes(self.v_proj(x).view(b, s, KV_HEADS, HEAD_DIM), 1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        k, v = repeat_interleaved(k, HEADS // KV_HEADS), repeat_interleaved(v, HEADS // KV_HEADS)
        scores = mask + ops.matmul(q, ops.swapaxes(k, -1, -2))
        probs = ops.softmax(scores, axis=-1, dtype=ms.float32)
        return self.o_proj(ops.swapaxes(ops.matmul(probs, v), 1, 2).reshape(b, s, -1))


def rotate_every_two(x):
    return ops.stack((-x[..., 1::2], x[..., ::2]), -1).reshape(x.shape)


def apply_interleaved(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_every_two(q) * sin, k * cos + rotate_every_two(k) * sin


class BooleanHide(SelfAttn):
    """A boolean mask, True where a key is hidden, by masked_fill; interleaved (GPT-J) RoPE."""

    def construct(self, x, cos, sin, mask):
        q, k, v = self.heads(x)
        q, k = apply_interleaved(q, k, cos, sin)
        k, v = repeat_kv(k, HEADS // KV_HEADS), repeat_kv(v, HEADS // KV_HEADS)
        w = ops.matmul(q, k.swapaxes(2, 3)) * self.scaling
        w = w.masked_fill(mask < 0, float("-inf"))
        w = ops.softmax(w, axis=-1)
        return self.merge(ops.matmul(w, v))


class BooleanKeep(SelfAttn):
    """A boolean mask, True where a key is attended, by ops.where."""

    def construct(self, x, cos, sin, mask):
        q, k, v = self.heads(x)
        q, k = apply_rotary(q, k, cos, sin)
        k, v = repeat_kv(k, HEADS // KV_HEADS), repeat_kv(v, HEADS // KV_HEADS)
        w = ops.matmul(q, k.swapaxes(2, 3)) / math.sqrt(HEAD_DIM)
        w = ops.where(mask == 0, w, -1e9)
        w = ops.softmax(w, axis=-1)
        return self.merge(ops.matmul(w, v))


def apply_rotary_merged(q, k, cos, sin):  # (B * H, S, D) against (1, S, D) tables
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class MergedHeads(SelfAttn):
    """Batch and heads merged into one axis, (B * H, S, D), and ops.bmm (no GQA here: 4 KV heads)."""

    def __init__(self):
        super().__init__()
        self.k_proj = nn.Dense(HIDDEN, HEADS * HEAD_DIM, has_bias=False)
        self.v_proj = nn.Dense(HIDDEN, HEADS * HEAD_DIM, has_bias=False)

    def construct(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, HEADS, HEAD_DIM).swapaxes(1, 2).reshape(b * HEADS, s, HEAD_DIM)
        k = self.k_proj(x).reshape(b, s, HEADS, HEAD_DIM).swapaxes(1, 2).reshape(b * HEADS, s, HEAD_DIM)
        v = self.v_proj(x).reshape(b, s, HEADS, HEAD_DIM).swapaxes(1, 2).reshape(b * HEADS, s, HEAD_DIM)
        q, k = apply_rotary_merged(q, k, cos, sin)
        scores = ops.bmm(q, k.transpose(0, 2, 1)) * self.scaling
        scores = scores + mask
        probs = ops.softmax(scores, axis=-1)
        out = ops.bmm(probs, v)
        return self.o_proj(out.reshape(b, HEADS, s, HEAD_DIM).swapaxes(1, 2).reshape(b, s, -1))


class RotaryCell(nn.Cell):
    def construct(self, q, k, cos, sin):
        return apply_rotary(q, k, cos, sin)


class HelperMethods(SelfAttn):
    """RoPE by a rotary sub-Cell, head repeats by a method of the class."""

    def __init__(self):
        super().__init__()
        self.rotary = RotaryCell()

    def repeat(self, x, n):
        return repeat_kv(x, n)

    def construct(self, x, cos, sin, mask):
        q, k, v = self.heads(x)
        q, k = self.rotary(q, k, cos, sin)
        k, v = self.repeat(k, HEADS // KV_HEADS), self.repeat(v, HEADS // KV_HEADS)
        w = ops.softmax(ops.matmul(q, k.swapaxes(2, 3)) * self.scaling + mask, axis=-1)
        return self.merge(ops.matmul(w, v))


def apply_partial(q, k, cos, sin):  # GPT-NeoX / Phi: RoPE on the first cos.shape[-1] features
    rd = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_rot, q_pass = q[..., :rd], q[..., rd:]
    k_rot, k_pass = k[..., :rd], k[..., rd:]
    q_rot = q_rot * cos + rotate_half(q_rot) * sin
    k_rot = k_rot * cos + rotate_half(k_rot) * sin
    return ops.cat((q_rot, q_pass), axis=-1), ops.cat((k_rot, k_pass), axis=-1)


class PartialRotary(SelfAttn):
    """Partial rotary: RoPE on half of each head."""
    rotary_dim = HEAD_DIM // 2

    def construct(self, x, cos, sin, mask):
        q, k, v = self.heads(x)
        q, k = apply_partial(q, k, cos, sin)
        k, v = repeat_kv(k, HEADS // KV_HEADS), repeat_kv(v, HEADS // KV_HEADS)
        w = ops.softmax(ops.matmul(q, k.swapaxes(2, 3)) * self.scaling + mask, axis=-1)
        return self.merge(ops.matmul(w, v))


def rotate_pairs(x, freqs_cis):
    pairs = x.reshape(x.shape[:-1] + (-1, 2))
    rotated = ops.Complex()(pairs[..., 0], pairs[..., 1]) * freqs_cis
    return ops.stack((ops.real(rotated), ops.imag(rotated)), -1).reshape(x.shape)


def apply_rotary_emb(q, k, freqs_cis):  # Meta's Llama: feature pairs rotated as complex numbers
    return rotate_pairs(q, freqs_cis), rotate_pairs(k, freqs_cis)


class ComplexPairs(SelfAttn):
    """Interleaved RoPE by complex pairs (``freqs_cis``, (S, D / 2) complex), construct(x, freqs_cis, mask)."""
    complex_rotations = True

    def construct(self, x, freqs_cis, mask):
        q, k, v = self.heads(x)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        k, v = repeat_kv(k, HEADS // KV_HEADS), repeat_kv(v, HEADS // KV_HEADS)
        w = ops.softmax(ops.matmul(q, k.swapaxes(2, 3)) * self.scaling + mask, axis=-1)
        return self.merge(ops.matmul(w, v))


class QOnlyRope(SelfAttn):
    """Near-miss: RoPE on q only."""

    def construct(self, x, cos, sin, mask):
        q, k, v = self.heads(x)
        k, v = repeat_kv(k, HEADS // KV_HEADS), repeat_kv(v, HEADS // KV_HEADS)
        q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
        w = ops.softmax(ops.matmul(q, k.swapaxes(2, 3)) / math.sqrt(HEAD_DIM) + mask, axis=-1)
        return self.merge(ops.matmul(w, v))


class AlibiLike(SelfAttn):
    """Near-miss: a position bias added to the scores besides the mask."""

    def construct(self, x, cos, sin, mask):
        q, k, v = self.heads(x)
        q, k = apply_rotary(q, k, cos, sin)
        k, v = repeat_kv(k, HEADS // KV_HEADS), repeat_kv(v, HEADS // KV_HEADS)
        s = x.shape[1]
        bias = -ops.abs(ops.arange(s).reshape(1, s) - ops.arange(s).reshape(s, 1)).astype(ms.float32) * 0.5
        w = ops.matmul(q, k.swapaxes(2, 3)) * self.scaling + bias + mask
        w = ops.softmax(w, axis=-1)
        return self.merge(ops.matmul(w, v))


class WrongAxis(SelfAttn):
    """Near-miss: the softmax over the queries' axis."""

    def construct(self, x, cos, sin, mask):
        q, k, v = self.heads(x)
        q, k = apply_rotary(q, k, cos, sin)
        k, v = repeat_kv(k, HEADS // KV_HEADS), repeat_kv(v, HEADS // KV_HEADS)
        w = ops.matmul(q, k.swapaxes(2, 3)) * self.scaling + mask
        w = ops.softmax(w, axis=-2)
        return self.merge(ops.matmul(w, v))


class Block(nn.Cell):
    def __init__(self, attention):
        super().__init__()
        self.attn = attention()
        self.mlp = nn.SequentialCell(nn.Dense(HIDDEN, 2 * HIDDEN), nn.ReLU(), nn.Dense(2 * HIDDEN, HIDDEN))

    def construct(self, x, cos, sin, mask):
        x = x + self.attn(x, cos, sin, mask)
        return x + self.mlp(x)


class ComplexBlock(Block):
    def construct(self, x, freqs_cis, mask):
        x = x + self.attn(x, freqs_cis, mask)
        return x + self.mlp(x)


class Ported(nn.Cell):
    def __init__(self, attention=SelfAttn, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.rotary = Rotary(getattr(attention, "rotary_dim", HEAD_DIM))
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


class PortedComplex(Ported):
    def __init__(self, attention=ComplexPairs, layers=2):
        super().__init__(attention, layers)
        self.blocks = nn.CellList([ComplexBlock(attention) for _ in range(layers)])
        self.inv_freq = Tensor(1.0 / (10000.0 ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM)))

    def construct(self, ids):
        s = ids.shape[1]
        angles = ops.arange(s).astype(ms.float32).reshape(s, 1) * self.inv_freq
        freqs_cis = ops.polar(ops.ones_like(angles), angles)
        mask = ops.triu(ops.full((s, s), -1e9, dtype=ms.float32), diagonal=1)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, freqs_cis, mask)
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


@pytest.fixture(params=["pynative", "graph"])
def mode(request):
    ms.set_context(mode=ms.PYNATIVE_MODE if request.param == "pynative" else ms.GRAPH_MODE)
    yield request.param
    ms.set_context(mode=ms.PYNATIVE_MODE)


def relative(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


ZOO = [SelfAttn, PackedQKV, ScaleFirst, BooleanHide, BooleanKeep, MergedHeads, HelperMethods, PartialRotary,
       ComplexPairs]


def ported(attention):
    ms.set_seed(0)
    model = PortedComplex(attention) if getattr(attention, "complex_rotations", False) else Ported(attention)
    model.set_train(False)
    return model


def fuse_strictly(model):
    report = fuse(model, strict=True)
    assert report.fused == ["blocks.0.attn", "blocks.1.attn"] and {s.family for s in report} == {"handwritten"}
    return report


@pytest.mark.parametrize("mode", ["pynative"], indirect=True)
@pytest.mark.parametrize("attention", ZOO)
def test_the_zoo_is_fused_in_both_modes(attention, mode, monkeypatch):
    """PyNative, with the op's calls counted; test_the_zoo_is_fused_in_one_graph is GRAPH_MODE's half."""
    model = ported(attention)
    want = model(ids()).asnumpy()
    report = fuse_strictly(model)
    calls = []
    real = runtime.rotary_flash_attention  # counted eagerly (a graph would trace the counter once, and cannot parse it)

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime, "rotary_flash_attention", counting)
    got = model(ids()).asnumpy()
    assert 0 < relative(got, want) < 1e-4, str(report)  # close, and not the original's bits: the op ran
    assert len(calls) == 2  # once per layer


@pytest.mark.parametrize("mode", ["graph"], indirect=True)
def test_the_zoo_is_fused_in_one_graph(mode, caplog):
    """The zoo in GRAPH_MODE, the fused models as one graph (its compile is linear in its size: 2-4
    graphs of the zoo cost as much, 9 twice as much). The originals run eagerly (on the CPU their
    graph gives the same bits, and would be a graph as large again); no fallback announced: each
    fused site took the op's branch."""
    models = [ported(attention) for attention in ZOO]
    with eager():
        wants = [model(ids()).asnumpy() for model in models]
    reports = [fuse_strictly(model) for model in models]
    caplog.clear()  # fuse probes the fused sites, and the probe of some runs their fallback
    gots = InOneGraph(models, [1] * len(models))(*[ids()] * len(models))
    for attention, report, want, got in zip(ZOO, reports, wants, gots):
        relative_error = relative(got.asnumpy(), want)
        assert 0 < relative_error < 1e-4, (attention.__name__, str(report))  # close, not the original's bits
    assert not [r.getMessage() for r in caplog.records if "rotary_fusion_fallback" in r.getMessage()]


@pytest.mark.parametrize("attention, reason", [
    (QOnlyRope, "no 'q, k = rope(q, k, cos, sin)'"),
    (AlibiLike, "expected the scores from q and the key (scaled, plus one mask)"),
    (WrongAxis, "a softmax not over the last axis"),
])
def test_near_misses_are_sites_not_fused_with_their_reason(attention, reason):
    ms.set_seed(0)
    model = Ported(attention)
    want = model(ids()).asnumpy()
    report = fuse(model)
    assert [s.name for s in report] == ["blocks.0.attn", "blocks.1.attn"], str(report)
    for site in report:
        assert site.status == "not fused" and site.reason.startswith("no fuse family recognises"), str(report)
        assert "hand-written style" in site.reason and reason in site.reason, site.reason
    assert "2 not fused" in str(report) and "blocks.1.attn" in str(report)
    np.testing.assert_array_equal(model(ids()).asnumpy(), want)
    with pytest.raises(FuseError, match="2 site"):
        fuse(model, strict=True)


def test_dropout_while_training_runs_the_original_and_says_so(caplog):
    ms.set_seed(0)
    model = Ported(PackedQKV)
    model.set_train(False)
    fuse(model, strict=True)
    model.set_train(True)
    ms.set_seed(1)
    model(ids())
    assert any("rotary_fusion_fallback: blocks.0.attn" in r.getMessage() and "dropout" in r.getMessage()
               for r in caplog.records)


def test_a_sliding_window_mask_runs_the_original_and_says_so(caplog):
    """A mask that is data: the site is fused, and a call whose mask is not exactly causal (a window of
    4) runs the original code, bit-identical, and says so."""
    ms.set_seed(0)
    model = Ported(SelfAttn)
    cos, sin = model.rotary(ops.arange(LENGTH).reshape(1, LENGTH))
    x = Tensor(np.random.default_rng(1).standard_normal((2, LENGTH, HIDDEN)).astype(np.float32))
    window = np.triu(np.full((LENGTH, LENGTH), -1e9, np.float32), 1) + np.tril(np.full((LENGTH, LENGTH), -1e9,
                                                                                          np.float32), -4)
    attn = model.blocks[0].attn
    want = attn(x, cos, sin, Tensor(window)).asnumpy()
    fuse(model, strict=True)
    np.testing.assert_array_equal(attn(x, cos, sin, Tensor(window)).asnumpy(), want)
    assert any("rotary_fusion_fallback: blocks.0.attn: the mask is not exactly causal" in r.getMessage()
               for r in caplog.records)


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


def test_rotations_that_differ_across_the_batch_run_the_original_and_say_so(caplog):
    """Per-sequence positions (the second sequence 3 positions on): the original runs, bit-identical,
    and the announcement names that reason alone."""
    ms.set_seed(0)
    model = Ported(SelfAttn)
    positions = Tensor(np.stack([np.arange(LENGTH), np.arange(LENGTH) + 3]).astype(np.int32))
    cos, sin = model.rotary(positions)
    x = Tensor(np.random.default_rng(2).standard_normal((2, LENGTH, HIDDEN)).astype(np.float32))
    causal = Tensor(np.triu(np.full((LENGTH, LENGTH), -1e9, np.float32), 1))
    attn = model.blocks[1].attn
    want = attn(x, cos, sin, causal).asnumpy()
    fuse(model, strict=True)
    np.testing.assert_array_equal(attn(x, cos, sin, causal).asnumpy(), want)
    messages = [r.getMessage() for r in caplog.records if "rotary_fusion_fallback: blocks.1.attn" in r.getMessage()]
    assert len(messages) == 1 and "the rotations differ across the batch" in messages[0], messages
