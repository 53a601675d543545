"""models/llama on tiny random checkpoints written by the tests: fused vs unfused, cache vs full
forward, varlen TND vs one by one, HF vs Meta layouts, an independent float64 numpy forward, and
checkpoint errors. Logit tolerance (float32, O(1) logits): 1e-4 absolute."""
import json

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor
from mindspore.nn.utils import no_init_parameters
from safetensors.numpy import save_file

from llama_reference import forward, hf_to_meta_qk
from models.llama import LlamaForCausalLM, preset
from models.llama.engine import sample
from models.llama.engine.cli import main
from models.llama import train as train_cli
from models.llama.weights import (CheckpointError, load_checkpoint, load_weights, model_state,
                                  save_hf_checkpoint)

ATOL = 1e-4
CONFIG = preset("tiny")


def state_shapes(config):
    """Each tensor's Hugging Face name and shape."""
    d = config.dim_per_head
    shapes = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
              "model.norm.weight": (config.hidden_size,), "lm_head.weight": (config.vocab_size, config.hidden_size)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (config.num_attention_heads * d, config.hidden_size),
            p + "self_attn.k_proj.weight": (config.num_key_value_heads * d, config.hidden_size),
            p + "self_attn.v_proj.weight": (config.num_key_value_heads * d, config.hidden_size),
            p + "self_attn.o_proj.weight": (config.hidden_size, config.num_attention_heads * d),
            p + "mlp.gate_proj.weight": (config.intermediate_size, config.hidden_size),
            p + "mlp.up_proj.weight": (config.intermediate_size, config.hidden_size),
            p + "mlp.down_proj.weight": (config.hidden_size, config.intermediate_size),
            p + "input_layernorm.weight": (config.hidden_size,),
            p + "post_attention_layernorm.weight": (config.hidden_size,)})
    return shapes


def random_state(config, rng):
    """Weights scaled 1/sqrt(fan_in) so activations and logits are O(1)."""
    state = {}
    for name, shape in state_shapes(config).items():
        if len(shape) == 1:
            state[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            state[name] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    return state


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    state = random_state(CONFIG, np.random.default_rng(7))
    return state, save_hf_checkpoint(state, CONFIG, tmp_path_factory.mktemp("hf"))


def ids_of(rng, *lengths):
    return [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in lengths]


def bsh_logits(model, ids):
    return model(Tensor(np.array([ids], np.int32))).asnumpy()[0]


def eager_logits(model, ids):
    """``bsh_logits`` in PyNative, whatever the test's mode: a reference forward that compiles no
    graph (in GRAPH_MODE every model and input length compiles one)."""
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        return bsh_logits(model, ids)
    finally:
        ms.set_context(mode=previous)


# The unfused attention compiles in about 3 s a layer and graph, and every layer runs the same code:
# the tests comparing it run its first layer only (load_checkpoint(num_layers=1)).
UNFUSED_LAYERS = 1


def projections_flags(model):
    return [cell.use_blas for _, cell in model.cells_and_names() if type(cell).__name__ == "Linear"]


@pytest.mark.parametrize("mode_name", ["graph", "pynative"])
def test_fused_equals_unfused_equals_float64_reference(checkpoint, mode_name, rng):
    """Fused and unfused attention, and the CPU's OpenBLAS projections (the default) and MindSpore's
    MatMul, each give the float64 reference's logits."""
    state, path = checkpoint
    ms.set_context(mode=ms.GRAPH_MODE if mode_name == "graph" else ms.PYNATIVE_MODE)
    fused = load_checkpoint(path, backend="fused", progress=False)
    unfused = load_checkpoint(path, backend="unfused", num_layers=UNFUSED_LAYERS, progress=False)
    matmul = load_checkpoint(path, backend="fused", progress=False, projections="matmul")
    assert (fused.backend, unfused.backend) == ("fused:CPU", "unfused")
    flags = projections_flags(fused), projections_flags(matmul)
    assert flags[0] and flags == ([True] * len(flags[0]), [False] * len(flags[0]))
    (ids,) = ids_of(rng, 37)
    expected = forward(state, CONFIG, ids)
    assert np.abs(bsh_logits(fused, ids) - expected).max() <= ATOL
    assert np.abs(bsh_logits(matmul, ids) - expected).max() <= ATOL
    one_layer = forward(state, CONFIG.replace(num_hidden_layers=UNFUSED_LAYERS), ids)
    assert np.abs(bsh_logits(unfused, ids) - one_layer).max() <= ATOL
    assert np.abs(expected).max() > 1 and np.abs(one_layer).max() > 1  # not a comparison of near-zero logits


def test_unknown_projections_is_refused():
    with pytest.raises(ValueError, match=r"projections: expected one of \['auto', 'matmul'\], got 'blas'"):
        LlamaForCausalLM(CONFIG, projections="blas")


@pytest.mark.parametrize("backend", ["fused", "unfused"])
def test_varlen_tnd_batch_equals_each_sequence_alone(checkpoint, backend, graph, rng):
    _, path = checkpoint
    layers = UNFUSED_LAYERS if backend == "unfused" else None
    single = load_checkpoint(path, backend=backend, num_layers=layers, progress=False)
    packed = load_checkpoint(path, backend=backend, layout="TND", num_layers=layers, progress=False)
    prompts = ids_of(rng, 1, 23, 7, 40)
    ends = Tensor(np.cumsum([len(p) for p in prompts]), ms.int64)
    logits = packed(Tensor(np.concatenate(prompts).astype(np.int32)), actual_seq_qlen=ends, actual_seq_kvlen=ends)
    alone = np.concatenate([eager_logits(single, p) for p in prompts])
    assert np.abs(logits.asnumpy() - alone).max() <= ATOL


def test_sampling():
    logits = np.array([[0.0, 5.0, 1.0, 4.0]])
    rng = np.random.default_rng(0)
    assert sample(logits, rng)[0] == 1
    assert sample(logits, rng, temperature=1.0, top_k=1)[0] == 1
    assert sample(logits, rng, temperature=1.0, top_p=0.5)[0] == 1  # token 1 alone holds > 50%
    draws = [sample(logits, rng, temperature=1.0, top_k=2)[0] for _ in range(400)]
    assert set(draws) == {1, 3}
    p1 = np.exp(5) / (np.exp(5) + np.exp(4))
    assert abs(np.mean(np.array(draws) == 1) - p1) < 0.08
    with pytest.raises(ValueError, match="top_p"):
        sample(logits, rng, temperature=1.0, top_p=0.0)


def meta_checkpoint(state, config, directory, shards=1):
    """The same weights in Meta's original layout: un-permuted wq/wk, Meta names, model-parallel shards."""
    names = {"model.embed_tokens.weight": ("tok_embeddings.weight", 1), "model.norm.weight": ("norm.weight", None),
             "lm_head.weight": ("output.weight", 0)}
    for i in range(config.num_hidden_layers):
        for hf, meta, dim in [("self_attn.q_proj", "attention.wq", 0), ("self_attn.k_proj", "attention.wk", 0),
                              ("self_attn.v_proj", "attention.wv", 0), ("self_attn.o_proj", "attention.wo", 1),
                              ("mlp.gate_proj", "feed_forward.w1", 0), ("mlp.down_proj", "feed_forward.w2", 1),
                              ("mlp.up_proj", "feed_forward.w3", 0), ("input_layernorm", "attention_norm", None),
                              ("post_attention_layernorm", "ffn_norm", None)]:
            names[f"model.layers.{i}.{hf}.weight"] = (f"layers.{i}.{meta}.weight", dim)
    tensors = {}
    for hf_name, (meta_name, dim) in names.items():
        w = state[hf_name]
        if hf_name.endswith("q_proj.weight"):
            w = hf_to_meta_qk(w, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = hf_to_meta_qk(w, config.num_key_value_heads)
        tensors[meta_name] = (w, dim)
    directory.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        shard = {n: np.ascontiguousarray(w if dim is None else np.split(w, shards, axis=dim)[s])
                 for n, (w, dim) in tensors.items()}
        save_file(shard, str(directory / f"consolidated.{s:02d}.safetensors"))
    params = {"dim": config.hidden_size, "n_layers": config.num_hidden_layers, "n_heads": config.num_attention_heads,
              "n_kv_heads": config.num_key_value_heads, "vocab_size": -1, "multiple_of": 32, "ffn_dim_multiplier": 0.9,
              "norm_eps": config.rms_norm_eps, "max_seq_len": config.max_position_embeddings}
    (directory / "params.json").write_text(json.dumps(params))
    return directory


@pytest.mark.parametrize("shards", [1, 2])
def test_meta_layout_equals_hf_layout(checkpoint, shards, graph, tmp_path, rng):
    state, path = checkpoint
    meta = load_checkpoint(meta_checkpoint(state, CONFIG, tmp_path / "meta", shards), progress=False)
    hf = load_checkpoint(path, progress=False)
    assert meta.config.rotary_mode == 1 and hf.config.rotary_mode == 0
    assert meta.config.intermediate_size == CONFIG.intermediate_size  # int(0.9 * int(8 * 64 / 3)) = 153, rounded up to 32: 160
    (ids,) = ids_of(rng, 29)
    assert np.abs(bsh_logits(meta, ids) - eager_logits(hf, ids)).max() <= ATOL


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_interleaved_model_saves_a_checkpoint_with_its_logits(partial, tmp_path, rng):
    """A model with interleaved q/k (as loaded from Meta's layout) saved by save_hf_checkpoint loads,
    as rotate-half, to the same logits; loaded back into an interleaved model (a training resume) too.
    The checkpoint is under test, not the mode: the forwards run in PyNative (no graph each)."""
    config = CONFIG.replace(rotary_mode=1, partial_rotary_factor=partial)
    state, interleaved = random_state(config, rng), LlamaForCausalLM(config)
    for name, param in interleaved.parameters_dict().items():
        param.set_data(Tensor(state[name]))
    saved = save_hf_checkpoint(model_state(interleaved), config, tmp_path / "saved")
    rotate_half = load_checkpoint(saved, progress=False)
    assert rotate_half.config.rotary_mode == 0
    resumed = LlamaForCausalLM(config)
    load_weights(resumed, saved, progress=False)
    (ids,) = ids_of(rng, 29)
    expected = eager_logits(interleaved, ids)
    assert np.abs(eager_logits(rotate_half, ids) - expected).max() <= 1e-5
    assert np.abs(eager_logits(resumed, ids) - expected).max() <= 1e-5


def test_training_from_a_meta_checkpoint_saves_its_logits(checkpoint, corpus, graph, tmp_path, rng):
    """One step at learning rate 0 from Meta's layout: out/step-1 loads to the Meta directory's logits
    (the checkpoints are under test: their forwards run in PyNative, no graph each; one layer, as each
    adds about 3 s to the train step's compile)."""
    meta = meta_checkpoint(checkpoint[0], CONFIG.replace(num_hidden_layers=1), tmp_path / "meta")
    train_cli.main(["--checkpoint", str(meta), "--data", str(corpus), "--out", str(tmp_path / "out"), "--steps", "1",
                    "--lr", "0", "--seq-len", "64", "--batch-size", "2"])
    (ids,) = ids_of(rng, 29)
    expected = eager_logits(load_checkpoint(meta, progress=False), ids)
    saved = eager_logits(load_checkpoint(tmp_path / "out" / "step-1", progress=False), ids)
    assert np.abs(saved - expected).max() <= 1e-5


def test_sharded_hf_checkpoint_and_tied_embeddings(checkpoint, tmp_path, rng):
    """The checkpoints are under test, not the mode: the forwards run in PyNative (no graph each; a
    tied model compiles in GRAPH_MODE in tests/test_checkpoint_configs.py)."""
    state, path = checkpoint
    sharded = save_hf_checkpoint(state, CONFIG, tmp_path / "sharded", max_shard_bytes=40_000)
    assert (sharded / "model.safetensors.index.json").exists()
    (ids,) = ids_of(rng, 9)
    one, many = load_checkpoint(path, progress=False), load_checkpoint(sharded, progress=False)
    assert np.abs(eager_logits(one, ids) - eager_logits(many, ids)).max() == 0
    tied_config = CONFIG.replace(tie_word_embeddings=True)
    tied_state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    tied = load_checkpoint(save_hf_checkpoint(tied_state, tied_config, tmp_path / "tied"), progress=False)
    assert np.abs(eager_logits(tied, ids) - forward(tied_state, tied_config, ids)).max() <= ATOL


def broken(state, tmp_path, edit):
    state = dict(state)
    edit(state)
    return save_hf_checkpoint(state, CONFIG, tmp_path / "broken")


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.pop("model.layers.1.mlp.up_proj.weight"), "missing tensor.*model.layers.1.mlp.up_proj.weight"),
    (lambda s: s.update({"model.layers.2.mlp.up_proj.weight": np.zeros((160, 64), np.float32)}),
     "unknown tensor 'model.layers.2.mlp.up_proj.weight'"),
    (lambda s: s.update({"model.norm.weight": np.ones(63, np.float32)}),
     r"'model.norm.weight'.*shape \(63,\), expected \(64,\)"),
    (lambda s: s.update({"model.norm.weight": np.ones(64, np.int32)}), "'model.norm.weight'.*dtype int32"),
])
def test_checkpoint_errors_name_the_tensor(checkpoint, edit, message, tmp_path):
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(broken(checkpoint[0], tmp_path, edit), progress=False)


def test_corrupt_and_missing_files(checkpoint, tmp_path):
    directory = save_hf_checkpoint(checkpoint[0], CONFIG, tmp_path / "corrupt")
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(directory, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither config.json"):
        load_checkpoint(tmp_path / "empty", progress=False)


def test_bfloat16_model_on_cpu_is_refused_clearly():
    with pytest.raises(ValueError, match="dtype: 'bfloat16'.*CPU"):
        LlamaForCausalLM(CONFIG, dtype="bfloat16")


def test_float16_model_close_to_float32(checkpoint, graph, rng):
    state, path = checkpoint
    (ids,) = ids_of(rng, 21)
    expected = forward(state, CONFIG, ids)
    half = bsh_logits(load_checkpoint(path, dtype="float16", progress=False), ids)
    # float16 weights and activations through 2 layers: a few float16 ulps of O(1) values.
    assert np.abs(half - expected).max() <= 0.05 * np.abs(expected).max()


def test_cli_with_tokenizer(checkpoint, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    _, path = checkpoint
    vocab = {f"w{i}": i for i in range(CONFIG.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    main(["--checkpoint", str(path), "--prompt", "w5 w9 w77", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert "prompt ids [1, 5, 9, 77] ->" in out and "TTFT" in out
    main(["--model", "tiny", "--layers", "1", "--ids", "1,2,3", "--ids", "4,5", "--max-new-tokens", "3",
          "--mode", "pynative"])
    assert capsys.readouterr().out.count("prompt ids") == 2
    (path / "tokenizer.json").unlink()


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cli_samples_at_the_default_top_p(capsys, paged):
    """``generate --temperature 0.8`` (top_p left at 1) exited 1 on about half its sampled tokens
    (review 2 F2): 3 prompts of 16 tokens each (48 draws) in one run, which compiles its graphs once,
    both engines, all printed. One layer: the sampling is under test, and each layer adds to the compiles."""
    main(["--model", "tiny", "--layers", "1", "--ids", "1,15,27", "--ids", "1,15,27", "--ids", "1,15,27",
          "--max-new-tokens", "16", "--temperature", "0.8"] + (["--paged"] if paged else []))
    assert capsys.readouterr().out.count("prompt ids [1, 15, 27] ->") == 3


def test_llama2_7b_dimensions_prefill_in_graph_mode(graph, rng):
    """The published 7B shapes (hidden 4096, 32 heads, MLP 11008, vocab 32000), one layer. Its 0.46 G
    weights repeat one block of a million random numbers, scaled 1/sqrt(fan_in): MindSpore's Normal
    initialisation of them took most of the test's 34 s, copying the block a seventh of that."""
    with no_init_parameters():
        model = LlamaForCausalLM(preset("7b", num_hidden_layers=1), logits="last")
    block = rng.standard_normal(1 << 20).astype(np.float32)
    for param in model.get_parameters():
        if param.has_init:  # the projections, embedding and LM head; the norms are ones already
            weights = np.empty(param.shape, np.float32)
            weights.reshape(-1, block.size)[:] = block / np.sqrt(param.shape[1])
            param.set_data(Tensor.from_numpy(weights))
    (ids,) = ids_of(rng, 33)
    logits = model(Tensor(np.array([ids], np.int32)))
    assert logits.shape == (1, 1, 32000)
    assert np.isfinite(logits.asnumpy()).all()
