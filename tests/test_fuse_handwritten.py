"""fuse() on a MindSpore Llama written in the common hand-written style (rotate_half,
q*cos + rotate_half(q)*sin, matmul / + mask / softmax / matmul), GRAPH_MODE and PyNative, and its
near-misses: a padding mask, rotated q/k read after the attention, a RoPE the op does not compute,
a RoPE that is a method or an expression. The rebuilt construct is never read from a file another
user could plant (issue 37)."""
import gc
import hashlib
import math
import tempfile
import types

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from ms_rope_attention import FuseError, fuse, rope_tables, unfuse
from ms_rope_attention.fusion import handwritten
from ms_rope_attention.fusion.handwritten.rebuild import rebuild_construct

HIDDEN, HEADS, LENGTH = 32, 4, 9


def rotate_half(x):
    half = x.shape[-1] // 2
    return ops.cat((-x[..., half:], x[..., :half]), -1)


def apply_rotary_pos_emb(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_every_two(x):
    return ops.stack((-x[..., 1::2], x[..., ::2]), -1).reshape(x.shape)


def apply_interleaved(q, k, cos, sin):  # GPT-J's interleaved RoPE: the op's rotary_mode 1
    return q * cos + rotate_every_two(q) * sin, k * cos + rotate_every_two(k) * sin


def apply_swapped(q, k, cos, sin):  # sin and cos swapped: no RoPE the op computes
    return q * sin + rotate_half(q) * cos, k * sin + rotate_half(k) * cos


class Attention(nn.Cell):
    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Dense(HIDDEN, HIDDEN) for _ in range(4))

    def heads(self, x):
        b, s, _ = x.shape
        return x.reshape(b, s, HEADS, self.head_dim).swapaxes(1, 2)

    def construct(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        scores = ops.matmul(q, k.swapaxes(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + mask
        probs = ops.softmax(scores, axis=-1)
        out = ops.matmul(probs, v)
        return self.o_proj(out.swapaxes(1, 2).reshape(b, s, HIDDEN))


class LeakyAttention(Attention):
    def construct(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        scores = ops.matmul(q, k.swapaxes(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + mask
        probs = ops.softmax(scores, axis=-1)
        out = ops.matmul(probs, v)
        return self.o_proj(out.swapaxes(1, 2).reshape(b, s, HIDDEN)) + k.sum()  # rotated k used elsewhere


class OtherRopeAttention(Attention):
    def construct(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))
        q, k = apply_swapped(q, k, cos, sin)
        scores = ops.matmul(q, k.swapaxes(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + mask
        probs = ops.softmax(scores, axis=-1)
        out = ops.matmul(probs, v)
        return self.o_proj(out.swapaxes(1, 2).reshape(b, s, HIDDEN))


class MethodRopeAttention(Attention):
    def rope(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)

    def construct(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))
        q, k = self.rope(q, k, cos, sin)
        scores = ops.matmul(q, k.swapaxes(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + mask
        probs = ops.softmax(scores, axis=-1)
        out = ops.matmul(probs, v)
        return self.o_proj(out.swapaxes(1, 2).reshape(b, s, HIDDEN))


FACTORY_CALLS = []


def rope_factory():
    FACTORY_CALLS.append("called")
    return apply_rotary_pos_emb


class FactoryRopeAttention(Attention):
    def construct(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))
        q, k = rope_factory()(q, k, cos, sin)
        scores = ops.matmul(q, k.swapaxes(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + mask
        probs = ops.softmax(scores, axis=-1)
        out = ops.matmul(probs, v)
        return self.o_proj(out.swapaxes(1, 2).reshape(b, s, HIDDEN))


rotary = types.ModuleType("rotary")
rotary.apply = apply_rotary_pos_emb


class ModuleRopeCastMaskAttention(Attention):
    def construct(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))
        q, k = rotary.apply(q, k, cos, sin)
        scores = ops.matmul(q, k.swapaxes(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + mask.astype(ms.float32)
        probs = ops.softmax(scores, axis=-1)
        out = ops.matmul(probs, v)
        return self.o_proj(out.swapaxes(1, 2).reshape(b, s, HIDDEN))


class Model(nn.Cell):
    def __init__(self, kind=Attention, layers=2):
        super().__init__()
        self.layers = nn.CellList([kind() for _ in range(layers)])

    def construct(self, x, cos, sin, mask):
        for layer in self.layers:
            x = x + layer(x, cos, sin, mask)
        return x


def inputs(pad=0, seed=0):
    rng = np.random.default_rng(seed)
    cos, sin = rope_tables(HIDDEN // HEADS, LENGTH)
    mask = np.triu(np.full((LENGTH, LENGTH), -1e9, np.float32), 1)
    if pad:
        mask[:, :pad] = -1e9  # left padding: not the causal rule
    return Tensor(rng.standard_normal((2, LENGTH, HIDDEN), dtype=np.float32)), Tensor(cos), Tensor(sin), Tensor(mask)


def run(model, args):
    return model(*args).asnumpy().astype(np.float64)


def test_every_layer_fused_outputs_match(mode):
    ms.set_seed(0)
    model = Model()
    want = run(model, inputs())
    report = fuse(model, strict=True)
    assert report.fused == ["layers.0", "layers.1"] and {s.family for s in report} == {"handwritten"}, str(report)
    got = run(model, inputs())
    assert 0 < np.abs(got - want).max() / np.abs(want).max() < 1e-4
    assert unfuse(model) == ["layers.0", "layers.1"]
    np.testing.assert_array_equal(run(model, inputs()), want)


def test_a_padding_mask_runs_the_original_and_says_so(mode, caplog):
    ms.set_seed(0)
    model = Model()
    want = run(model, inputs(pad=2))
    fuse(model, strict=True)
    np.testing.assert_array_equal(run(model, inputs(pad=2)), want)
    assert any("rotary_fusion_fallback: layers.0: the mask is not exactly causal" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("kind, reason", [
    (LeakyAttention, "['k'] (rotated q/k, repeated k/v, scores or probabilities) are read after the attention"),
    (OtherRopeAttention, "its RoPE function is neither rotate-half nor interleaved RoPE (checked on a probe)"),
    (FactoryRopeAttention, "its helper 'rope_factory()' is not a function of its module (a name or module.name) "
                           "nor a method or sub-Cell (self.name)")])
def test_near_misses_are_left_alone_with_their_reason(kind, reason):
    model = Model(kind, layers=1)
    report = fuse(model)
    assert report["layers.0"].outcome == f"not fused: {reason}"
    assert type(model.layers[0]) is kind
    with pytest.raises(FuseError):
        fuse(model, strict=True)
    assert FACTORY_CALLS == []  # fuse looks the RoPE function up; it evaluates no expression of the user's


@pytest.mark.parametrize("kind", [ModuleRopeCastMaskAttention, MethodRopeAttention])
def test_a_module_function_or_method_rope_and_a_mask_expression_are_fused(kind):
    ms.set_seed(0)
    model = Model(kind, layers=1)
    want = run(model, inputs())
    assert fuse(model, strict=True).fused == ["layers.0"]
    assert 0 < np.abs(run(model, inputs()) - want).max() / np.abs(want).max() < 1e-4


@pytest.mark.parametrize("mode", ["graph"], indirect=True)
@pytest.mark.parametrize("plant", ["a construct", "a dangling symlink"])
def test_nothing_planted_in_the_temp_directory_is_run_or_written(mode, plant, tmp_path, monkeypatch):
    """Where fuse once wrote the rebuilt construct (a shared, predictable path, which MindSpore's
    parser then read), another user plants code or a symlink: the model still computes its own
    attention, the symlink is not followed, and fuse writes nothing there."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    source = rebuild_construct(Attention.construct)[0]
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    planted = tmp_path / "ms_rope_attention-fused-constructs" / f"construct_{digest}.py"
    planted.parent.mkdir()
    if plant == "a construct":
        planted.write_text(source.replace("    return ", "    out = out * 0\n    return "))
        assert "out = out * 0" in planted.read_text()
    else:
        planted.symlink_to(tmp_path / "victim")
    before = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    ms.set_seed(0)
    model = Model(type("FreshAttention", (Attention,), {}), layers=1)  # a class fuse has not rebuilt yet
    want = run(model, inputs())
    assert fuse(model, strict=True).fused == ["layers.0"]
    assert 0 < np.abs(run(model, inputs()) - want).max() / np.abs(want).max() < 1e-4
    assert {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")} == before
    assert not (tmp_path / "victim").exists()
    name = type(model.layers[0]).construct.__code__.co_filename
    assert name.startswith("<") and name.endswith(">")  # a name linecache never reads from disk


class MethodInterleavedAttention(Attention):
    def rope(self, q, k, cos, sin):
        return apply_interleaved(q, k, cos, sin)

    def construct(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))
        q, k = self.rope(q, k, cos, sin)
        scores = ops.matmul(q, k.swapaxes(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + mask
        probs = ops.softmax(scores, axis=-1)
        out = ops.matmul(probs, v)
        return self.o_proj(out.swapaxes(1, 2).reshape(b, s, HIDDEN))


def test_a_site_given_a_collected_sites_id_inherits_nothing(monkeypatch):
    """What fuse learns about one site (its own RoPE method's mode, a probe's table shape) lives and
    dies with that site. An id is given again to the next object at a collected one's address, so
    state keyed by ``id(site)`` would pass to a stranger: here every object gets the same id, which
    makes that reuse certain instead of likely."""
    monkeypatch.setattr(handwritten, "id", lambda obj: 0, raising=False)
    first = Model(MethodInterleavedAttention, layers=1)
    assert fuse(first, dry_run=True).fused == ["layers.0"]  # learns the interleaved mode, installs nothing
    del first
    gc.collect()
    ms.set_seed(0)
    second = Model(layers=1)  # rotate-half, by a function of its module: nothing learnt per site
    want = run(second, inputs())
    assert fuse(second, strict=True).fused == ["layers.0"]
    assert 0 < np.abs(run(second, inputs()) - want).max() / np.abs(want).max() < 1e-4
