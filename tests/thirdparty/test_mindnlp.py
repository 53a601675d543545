"""fuse() on Hugging Face Llama / Mistral / Qwen2 as mindnlp 0.5.1 runs them (PyNative, tiny random
weights), with HF's KV cache; and the two bugs mindnlp exposed (dtype names, device tags)."""
import mindspore as ms
import numpy as np
import pytest

from ms_rope_attention.fusion import mindnlp_compat

mindnlp_compat.install()
import mindnlp  # noqa: E402,F401
import torch  # noqa: E402  (mindtorch, through mindnlp's import hook)
import transformers  # noqa: E402

from ms_rope_attention import checks, fuse, rope_tables, rotary_flash_attention, unfuse  # noqa: E402
from ms_rope_attention.fusion import hf_llama as family  # noqa: E402

PROMPT = [[1, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10]]


def tiny(kind="llama", seed=0, **overrides):
    settings = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
    settings.update(overrides)
    config = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
              "qwen2": transformers.Qwen2Config}[kind](**settings)
    torch.manual_seed(seed)
    model = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
             "qwen2": transformers.Qwen2ForCausalLM}[kind](config)
    return model.eval()


def run(model, ids, **kwargs):
    with torch.no_grad():
        return model(torch.tensor(ids), **kwargs).logits.float().numpy().astype(np.float64)


def generate(model, ids, **kwargs):
    with torch.no_grad():
        return model.generate(torch.tensor(ids), max_new_tokens=6, do_sample=False, **kwargs).numpy()


def relative(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("kind, implementation", [("llama", "sdpa"), ("llama", "eager"), ("mistral", "sdpa"),
                                                  ("qwen2", "sdpa")])
def test_every_site_fused_logits_match_and_generation_is_unchanged(kind, implementation, spy):
    overrides = {"sliding_window": None} if kind in ("mistral", "qwen2") else {}
    model = tiny(kind, attn_implementation=implementation, **overrides)
    want, want_tokens = run(model, PROMPT), generate(model, PROMPT, attention_mask=torch.ones(1, 11, dtype=torch.long))
    calls = spy(family)
    report = fuse(model, strict=True)
    assert report.fused == ["model.layers.0.self_attn", "model.layers.1.self_attn"], str(report)
    assert relative(run(model, PROMPT), want) < 1e-4
    calls.clear()
    tokens = generate(model, PROMPT, attention_mask=torch.ones(1, 11, dtype=torch.long))
    np.testing.assert_array_equal(tokens, want_tokens)
    prefill = [c for c in calls if c.get("return_rotated_key")]
    decode = [c for c in calls if c.get("key_rotated")]
    assert len(prefill) == 2 and len(decode) == 2 * 5, (len(prefill), len(decode))  # 2 layers, 5 cached steps
    assert unfuse(model) == report.fused
    np.testing.assert_array_equal(run(model, PROMPT), want)


# Four prompts of unequal lengths (3, 11, 7, 1 tokens): HF's generate left-pads them.
UNEQUAL = [[5, 9, 13], [1, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10], [3, 1, 4, 1, 5, 9, 2], [7]]


def left_padded(prompts):
    longest = max(map(len, prompts))
    ids = [[0] * (longest - len(p)) + p for p in prompts]
    mask = [[0] * (longest - len(p)) + [1] * len(p) for p in prompts]
    return torch.tensor(ids), torch.tensor(mask)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_left_padded_batch_decodes_fused_every_step(implementation, spy, fallback_warnings):
    """Batch-4 greedy generation, prompts of unequal lengths (the sequences at different positions in
    every step): the same tokens as the original, every layer of the prefill and of each of the 5
    cached steps in the fused op (TND: each sequence's padding a segment of its own), no fallback."""
    model = tiny(attn_implementation=implementation)
    ids, mask = left_padded(UNEQUAL)

    def tokens():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0).numpy()

    want = tokens()
    assert fuse(model, strict=True).all_fused
    calls = spy(family)
    np.testing.assert_array_equal(tokens(), want)
    assert not fallback_warnings()
    prefill = [c for c in calls if c.get("return_rotated_key")]
    decode = [c for c in calls if c.get("key_rotated")]
    assert len(prefill) == 2 and len(decode) == 2 * 5, (len(prefill), len(decode))
    assert all(c.get("input_layout") == "TND" for c in calls)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_left_padded_logits_match_at_every_real_token(implementation):
    """One forward of the padded batch with HF's left-padded position_ids, then one cached step:
    every real token's logits within 1e-4 of the original's (the padding rows are HF's don't-care)."""
    model = tiny(attn_implementation=implementation)
    ids, mask = left_padded(UNEQUAL)
    positions = torch.tensor(np.maximum(np.cumsum(mask.numpy(), 1) - 1, 0))
    step_ids, step_mask = torch.tensor([[3], [4], [5], [6]]), torch.cat((mask, torch.ones(4, 1, dtype=mask.dtype)), 1)
    step_positions = torch.tensor(positions.numpy()[:, -1:] + 1)

    def logits():
        with torch.no_grad():
            first = model(ids, attention_mask=mask, position_ids=positions, use_cache=True)
            step = model(step_ids, attention_mask=step_mask, position_ids=step_positions,
                         past_key_values=first.past_key_values, use_cache=True)
        return [x.logits.float().numpy().astype(np.float64) for x in (first, step)]

    want = logits()
    fuse(model, strict=True)
    got = logits()
    real = mask.numpy().astype(bool)
    assert relative(got[0][real], want[0][real]) < 1e-4
    assert relative(got[1], want[1]) < 1e-4


def test_a_padded_batch_at_unpadded_positions_runs_the_original_code_and_says_so(fallback_warnings):
    """Padding in the mask but positions 0..S-1 for every row (no position_ids: HF's default): the
    rotations do not follow the mask, so the original runs, bit-identical, and says why."""
    model = tiny()
    ids = [[0, 0, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    want = run(model, ids, attention_mask=mask)
    assert fuse(model).all_fused
    np.testing.assert_array_equal(run(model, ids, attention_mask=mask), want)
    assert any("model.layers.0.self_attn" in m and "positions do not follow the mask" in m
               for m in fallback_warnings())


def test_right_padding_runs_the_original_code_and_says_so(fallback_warnings):
    model = tiny()
    ids = [[3, 4, 5, 6, 0, 0], [1, 2, 3, 4, 5, 6]]
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    want = run(model, ids, attention_mask=mask)
    fuse(model)
    np.testing.assert_array_equal(run(model, ids, attention_mask=mask), want)
    assert any("not causal with left padding" in m for m in fallback_warnings())


def test_a_projection_with_a_hook_is_called_as_a_module():
    """The fused forward runs q/k/v/o on the project's GEMM only for a plain nn.Linear: a forward hook
    on one (here doubling v) still runs, so the fused model equals the hooked original."""
    model = tiny()
    for layer in model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda module, args, out: out * 2)
    want = run(model, PROMPT)
    fuse(model, strict=True)
    assert relative(run(model, PROMPT), want) < 1e-4


def test_attention_dropout_while_training_runs_the_original(fallback_warnings, spy):
    model = tiny(attention_dropout=0.5)
    fuse(model)
    calls = spy(family)
    model.train()
    with torch.no_grad():
        model(torch.tensor(PROMPT))
    assert not calls and any("attention dropout 0.5 while training" in m for m in fallback_warnings())


def test_what_is_not_covered_is_reported():
    report = fuse(tiny("mistral", sliding_window=4), dry_run=True)
    assert report["model.layers.0.self_attn"].reason == "sliding_window=4: not covered"
    model = tiny()
    model.model.layers[1].self_attn.forward = lambda *args, **kwargs: None
    report = fuse(model)
    assert report.fused == ["model.layers.0.self_attn"]
    assert report["model.layers.1.self_attn"].reason == "its forward was replaced on the instance"


def test_dtype_names_as_mindtorch_prints_them():
    """Bug 1: with mindtorch loaded, str(ms.float32) is 'mindspore.float32'."""
    assert str(ms.float32) == "mindspore.float32"
    assert checks.dtype_name(ms.float32) == "float32" and checks.dtype_name(ms.bfloat16) == "bfloat16"


def test_outputs_carry_mindtorchs_device_tag():
    """Bug 2: mindtorch's DynamicCache reads key.device, which untagged tensors refuse."""
    rng = np.random.default_rng(0)
    q, k, v = (torch.tensor(rng.standard_normal((1, 2, 5, 16), dtype=np.float32)) for _ in range(3))
    cos, sin = (torch.tensor(t) for t in rope_tables(16, 8))
    out, rotated_key = rotary_flash_attention(q, k, v, cos, sin, return_rotated_key=True)
    assert out.device == q.device and rotated_key.device == q.device
    cache = transformers.DynamicCache()
    keys, _ = cache.update(rotated_key, v, 0)
    assert keys.shape == (1, 2, 5, 16)


def test_the_private_interfaces_compat_reads_are_there():
    """What ms_rope_attention/_compat.py reads of transformers and mindtorch, pinned to the versions
    of this environment: the config's attention implementation, mindtorch's device tag, and its
    modules' forward hooks (own and global)."""
    from ms_rope_attention import _compat

    model = tiny()
    assert _compat.attention_implementation(model.config) == model.config._attn_implementation
    assert model.config._attn_implementation in ("eager", "sdpa")
    x = torch.ones(2)
    assert hasattr(x, "_device"), "mindtorch tensors carry a _device tag"
    out = ms.Tensor(np.ones(2, np.float32))
    _compat.copy_device_tag([out], x)
    assert out._device == x._device
    linear = torch.nn.Linear(2, 2)
    assert not _compat.has_forward_hooks(linear)
    for register in (linear.register_forward_hook, linear.register_forward_pre_hook,
                     torch.nn.modules.module.register_module_forward_hook,
                     torch.nn.modules.module.register_module_forward_pre_hook):
        handle = register(lambda *args: None)
        assert _compat.has_forward_hooks(linear), register
        handle.remove()
    assert not _compat.has_forward_hooks(linear)
