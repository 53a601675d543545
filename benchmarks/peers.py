"""The systems and inputs the benchmarks share, so that no benchmark script imports another.

- One model for every system: ``write_checkpoint`` writes the seeded random Llama as a Hugging Face
  checkpoint that each system loads (``write_half_checkpoint``: float16 weights, one layer at a time),
  ``write_char_tokenizer`` a tokenizer for it; ``prompt_ids`` and ``prompts_for`` are the seeded prompts;
  ``weights_checksum`` and ``logits_probe`` prove that the systems computed the same model.
- The prefill points (``benchmarks/ttft.py``'s peers, ``fuse.py`` and ``projections.py`` reuse the
  parts): ``timed_prefill``, transformers' prefill (``hf_prefill_point``), MindFormers' Llama loaded
  as it runs on a CPU (``load_mindformers``) and its prefill (``mindformers_prefill_point``).
- The generation points (``benchmarks/decode.py``'s systems, ``half_weights.py`` runs them too):
  this project's ``Generator`` (``project_generation_point``), transformers' ``generate``
  (``hf_generation_point``, with ``hf_generate`` and the time-stamping streamer ``hf_stamps`` that
  ``serving.py`` and ``fuse.py`` use), and ``generation_point``, which picks between them.

Each point is run in a child process by ``harness.run_isolated("peers", ...)``; MindFormers' and
mindnlp's run under their own virtual environments' interpreters, so this module imports only
numpy and ``harness`` at the top (llama.cpp's points, ``llama_cpp_peer``, import its prompts and logits
probe under llama.cpp's interpreter too). (``benchmarks/peers/`` beside it holds those environments'
requirement files; ``import peers`` finds this module, which takes precedence over a folder without
``__init__.py``.)
"""
from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from harness import stats, timed, timed_calls

WARM_UP_TOKENS = 16  # a generation point compiles / warms up on prompts cut to this many tokens


# ---------------------------------------------------------------------------------------------
# One model for every system: the weights, the prompts, the proof that they computed the same thing.

def write_checkpoint(model: str, layers: int, seed: int, directory: str) -> dict:
    """The sweep's seeded random weights as a Hugging Face checkpoint (child process)."""
    import mindspore as ms

    ms.set_device("CPU")
    from models.llama import LlamaForCausalLM, preset
    from models.llama.weights import model_state, save_hf_checkpoint

    ms.set_seed(seed)
    config = preset(model, num_hidden_layers=layers)
    lm = LlamaForCausalLM(config, dtype="float32", backend="unfused", logits="last")
    save_hf_checkpoint(model_state(lm), config, directory)
    return {"directory": directory}


def write_half_checkpoint(model: str, layers: int, seed: int, directory: str) -> dict:
    """The seeded random weights as a float16 Hugging Face checkpoint, one layer at a time (a
    32-layer model never exists in float32 in this process)."""
    import mindspore as ms
    from mindspore.nn.utils import no_init_parameters

    ms.set_device("CPU")
    from models.llama import LlamaForCausalLM, preset
    from models.llama.weights import save_hf_checkpoint

    config = preset(model, num_hidden_layers=layers)
    rng = np.random.default_rng(seed)
    with no_init_parameters():  # the shapes only
        one_layer = LlamaForCausalLM(config.replace(num_hidden_layers=1), dtype="float32", backend="unfused")
    shapes = {name: tuple(p.shape) for name, p in one_layer.parameters_dict().items()}
    state = {}
    for name, shape in shapes.items():
        names = [name] if ".layers.0." not in name else [name.replace(".layers.0.", f".layers.{i}.") for i in range(layers)]
        for n in names:
            if len(shape) == 1:
                state[n] = np.ones(shape, np.float16)
            else:  # 1/sqrt(fan_in): O(1) activations, as the model's own initialiser gives
                state[n] = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])).astype(np.float16)
    save_hf_checkpoint(state, config, directory, max_shard_bytes=2 * 2**30)
    return {"directory": directory, "bytes": int(sum(a.nbytes for a in state.values()))}


CHAR_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: Llama 2's unknown, begin and end of sequence
SPACE = "\u2581"  # SentencePiece's space, as Llama's tokenizers and llama.cpp's "llama" vocabulary write it


# Where the character tokenizer's ids past printable ASCII come from, in order: CJK Unified Ideographs, CJK
# Extension A, Hangul syllables (38,756 characters: enough for Llama 2's 32,000 ids, and each one character in
# every tokenizer here, none of them normalised away).
CHAR_FILL_RANGES = ((0x4E00, 0xA000), (0x3400, 0x4DC0), (0xAC00, 0xD7A4))


def char_vocabulary(vocab_size: int) -> list[str]:
    """The tokens of ``write_char_tokenizer``, by id: Llama 2's three special tokens, then one
    character per id: the space (as ``SPACE``), the newline, the tab, printable ASCII, then the
    characters of ``CHAR_FILL_RANGES`` to fill ``vocab_size``."""
    chars = [SPACE, "\n", "\t", *(chr(c) for c in range(0x21, 0x7F))]
    fill = vocab_size - len(CHAR_SPECIAL_TOKENS) - len(chars)
    if fill < 0:
        raise ValueError(f"vocab_size: a character tokenizer needs at least "
                         f"{len(CHAR_SPECIAL_TOKENS) + len(chars)} ids (printable ASCII), got {vocab_size}")
    extra = [chr(c) for lo, hi in CHAR_FILL_RANGES for c in range(lo, hi)]
    if fill > len(extra):
        raise ValueError(f"vocab_size: at most {len(CHAR_SPECIAL_TOKENS) + len(chars) + len(extra)} ids, "
                         f"got {vocab_size}")
    return [*CHAR_SPECIAL_TOKENS, *chars, *extra[:fill]]


def write_char_tokenizer(directory: str, vocab_size: int) -> dict:
    """A tokenizer of one character per token for a random checkpoint, written with the
    ``tokenizers`` package into ``directory`` (``tokenizer.json``, and a ``tokenizer_config.json``
    naming the special tokens, which transformers' ``AutoTokenizer`` reads: a load generator's
    client-side tokenizer). Its vocabulary is ``char_vocabulary``: no merges and no byte tokens, so

    - llama.cpp reads the same vocabulary from a GGUF file (``llama_cpp_peer.write_gguf(...,
      tokenizer=...)``) and its SentencePiece-style tokenizer, which merges only into tokens that
      exist, splits any text of these characters exactly as this one does: a prompt is the same
      tokens for every server;
    - a text of N characters is N tokens, and any ids decode to whole characters (a random model's
      output counted again on the client gives back its token count).

    A space is ``SPACE`` inside (normalised in, decoded back), as Llama's SentencePiece tokenizer
    has it; nothing is added (the server adds BOS). Characters outside the vocabulary are ``<unk>``
    here and have no id at all in llama.cpp (no byte tokens to fall back on): the texts it is for (aiperf's
    Shakespeare corpus, Llama 2's chat template) are ASCII."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tokens = char_vocabulary(vocab_size)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token=CHAR_SPECIAL_TOKENS[0]))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAR_SPECIAL_TOKENS])
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    unk, bos, eos = CHAR_SPECIAL_TOKENS
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": unk, "bos_token": bos, "eos_token": eos,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False}, indent=2))
    return {"directory": str(path), "vocab_size": vocab_size}


def weights_checksum(down_proj_rows: np.ndarray) -> float:
    """Layer 0's MLP down projection, first rows: stored the same way by every system (q/k projections
    may be permuted for a rotary layout, this one never is)."""
    return float(np.asarray(down_proj_rows, np.float64).sum())


def prompt_ids(seed: int, batch: int, length: int, vocab_size: int) -> list:
    """The sweep's prompt, the same for every system: seeded random ids, never 0 (MindFormers' pad id,
    which its causal mask would hide)."""
    return np.random.default_rng(seed).integers(1, vocab_size, (batch, length)).tolist()


def prompts_for(batch: str, context: int, vocab: int, seed: int) -> list[list[int]]:
    """The prompts of a point: one of ``context`` tokens, or eight spread over [context/8, context]."""
    rng = np.random.default_rng(seed + context)
    lengths = [context] if batch == "1" else [max(1, context * (i + 1) // 8) for i in range(8)]
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


LOGITS_PROBE = 64  # leading logits of the last token each system reports


def logits_probe(logits) -> list:
    """The last token's first logits (batch row 0): every system must agree on them."""
    return [float(x) for x in np.asarray(logits, np.float64).reshape(np.shape(logits)[0], -1)[0, :LOGITS_PROBE]]


def timed_prefill(last_logits, repeats: int) -> tuple[float, list[float], list]:
    """(compile/warm-up seconds, timed seconds, logits probe) of a prefill: ``last_logits()`` returns the
    last token's logits (B, vocab) as numpy, and choosing the first token (argmax) is part of the time."""
    last = {}

    def prefill():
        last["logits"] = last_logits()
        return last["logits"].argmax(-1)
    compile_s, times = timed(prefill, repeats)
    return compile_s, times, logits_probe(last["logits"])


# ---------------------------------------------------------------------------------------------
# The prefill points of the peers (child processes).

def hf_prefill_point(checkpoint: str, length: int, repeats: int, seed: int, batch: int, dtype: str) -> dict:
    """The peer: transformers' LlamaForCausalLM with PyTorch's sdpa attention on the same checkpoint, all
    cores, the prefill a ``generate`` call would run (KV cache on, logits of the last token only)."""
    import torch
    import torch.nn.functional as F
    import transformers

    torch.set_num_threads(os.cpu_count())
    start = time.perf_counter()
    lm = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype),
                                                       attn_implementation="sdpa").eval()
    build_s = time.perf_counter() - start
    config = lm.config
    ids = torch.tensor(prompt_ids(seed, batch, length, config.vocab_size))

    def last_logits():
        with torch.inference_mode():
            return lm(ids, logits_to_keep=1).logits[:, -1].float().numpy()
    compile_s, ttft, probe_logits = timed_prefill(last_logits, repeats)

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    q = torch.randn(batch, heads, length, head_dim, dtype=getattr(torch, dtype))
    k, v = (torch.randn(batch, kv_heads, length, head_dim, dtype=q.dtype) for _ in range(2))
    rotary = lm.model.rotary_emb
    position_ids = torch.arange(length).unsqueeze(0)
    apply_rope = transformers.models.llama.modeling_llama.apply_rotary_pos_emb

    def attention():  # one layer's RoPE + sdpa, as the model runs them
        with torch.inference_mode():
            cos, sin = rotary(q, position_ids)
            qr, kr = apply_rope(q, k, cos, sin)
            return F.scaled_dot_product_attention(qr, kr, v, is_causal=True, enable_gqa=kv_heads != heads)

    def head():  # embedding, final norm, LM head on the last token
        with torch.inference_mode():
            return lm.lm_head(lm.model.norm(lm.model.embed_tokens(ids))[:, -1:])
    _, attention_times = timed(attention, repeats)
    _, head_times = timed(head, repeats)
    # the bfloat16 systems compare the embedding's rows (ttft.ttft_point says why)
    probe = (lm.model.embed_tokens.weight if dtype == "bfloat16" else lm.model.layers[0].mlp.down_proj.weight)
    probe = probe[:8].detach().float().numpy()
    return {"backend_ran": f"transformers {transformers.__version__}, torch {torch.__version__}", "build_s": build_s,
            "compile_s": compile_s, "ttft": stats(ttft), "attention": stats(attention_times), "head": stats(head_times),
            "weights_checksum": weights_checksum(probe), "logits_probe": probe_logits}


def load_mindformers(checkpoint: str, length: int, batch: int, dtype: str, **settings):
    """(MindFormers' LlamaForCausalLM on ``checkpoint``'s weights, hf config dict, seconds to build it),
    configured as MindFormers runs on a CPU (no flash attention, sliced rotate-half RoPE, unfused
    RMSNorm, no KV cache) unless ``settings`` (LlamaConfig fields) say otherwise; GRAPH_MODE unless
    the caller set another mode. Runs in MindFormers' own virtual environment."""
    import mindformers_compat
    mindformers_compat.install()
    # MindFormers writes its logs under LOCAL_DEFAULT_PATH (./output by default): keep them out of the tree.
    os.environ.setdefault("LOCAL_DEFAULT_PATH", tempfile.mkdtemp(prefix="mindformers-output-"))
    import mindspore as ms
    from mindspore import Tensor
    from mindspore.nn.utils import no_init_parameters
    from safetensors import safe_open

    ms.set_device("CPU")
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM

    hf = json.loads((Path(checkpoint) / "config.json").read_text())
    start = time.perf_counter()
    config = LlamaConfig(**{
        **dict(batch_size=batch, seq_length=length, hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
               num_heads=hf["num_attention_heads"], n_kv_heads=hf["num_key_value_heads"],
               intermediate_size=hf["intermediate_size"], vocab_size=hf["vocab_size"], rms_norm_eps=hf["rms_norm_eps"],
               theta=hf["rope_theta"], max_position_embedding=max(length, hf["max_position_embeddings"]),
               compute_dtype=dtype, layernorm_compute_type="float32", softmax_compute_type="float32",
               rotary_dtype="float32", param_init_type=dtype, use_past=False, use_flash_attention=False,
               use_rope_slice=True, fused_rms_norm=False, bos_token_id=hf.get("bos_token_id", 1),
               eos_token_id=hf.get("eos_token_id", 2), pad_token_id=0),
        **settings})
    with no_init_parameters():  # every weight comes from the checkpoint, as in this project's loader
        lm = LlamaForCausalLM(config)
    lm.set_train(False)
    # Tensor by tensor into the model's own parameters, as this project's loader does: a dict of every
    # converted tensor first (load_param_into_net) would hold the model twice and inflate the peer's peak.
    own = lm.parameters_dict()
    loaded, unexpected = set(), []
    for file in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(file), framework="np") as f:
            for name in f.keys():
                ms_name = LlamaForCausalLM.convert_name(name)
                if ms_name not in own:
                    unexpected.append(ms_name)
                    continue
                value = Tensor.from_numpy(f.get_tensor(name)).astype(own[ms_name].dtype)
                if value.shape != own[ms_name].shape:
                    raise RuntimeError(f"MindFormers checkpoint mapping: {ms_name} is {value.shape} in {file}, "
                                       f"the model has {own[ms_name].shape}")
                own[ms_name].set_data(value)
                loaded.add(ms_name)
    missing = []
    for name in sorted(set(own) - loaded):
        if name.endswith(("key_cache", "value_cache")):  # use_past's paged KV cache: state, not weights
            own[name].init_data()
        else:
            missing.append(name)
    if missing or unexpected:
        raise RuntimeError(f"MindFormers checkpoint mapping: missing {missing}, unexpected {unexpected}")
    return lm, hf, time.perf_counter() - start


def mindformers_prefill_point(checkpoint: str, length: int, repeats: int, seed: int, batch: int, dtype: str) -> dict:
    """The other peer: MindFormers' Llama (``mindformers.models.llama.LlamaForCausalLM``, MindSpore
    GRAPH_MODE) on the same checkpoint, configured as MindFormers runs on a CPU (no flash attention,
    sliced rotate-half RoPE, unfused RMSNorm, no KV cache), the prefill computing the last token's logits
    (``batch_valid_length``). Runs in MindFormers' own virtual environment (see ``--mindformers-python``)."""
    import mindspore as ms
    from mindspore import Tensor, nn

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    lm, hf, build_s = load_mindformers(checkpoint, length, batch, dtype)
    import mindformers
    ids = Tensor(np.array(prompt_ids(seed, batch, length, hf["vocab_size"]), np.int32))
    valid = Tensor(np.full((batch,), length, np.int32))
    compile_s, ttft, probe_logits = timed_prefill(
        lambda: lm(ids, batch_valid_length=valid)[0].asnumpy().reshape(batch, -1), repeats)

    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf["hidden_size"] // heads
    rng = np.random.default_rng(seed)
    q = Tensor(rng.standard_normal((batch, heads, length, head_dim), dtype=np.float32)).astype(getattr(ms, dtype))
    k, v = (Tensor(rng.standard_normal((batch, kv_heads, length, head_dim), dtype=np.float32)).astype(q.dtype)
            for _ in range(2))

    class Attention(nn.Cell):
        """One layer's RoPE + attention, as the model runs them (mask, rotation, repeat_kv, softmax)."""

        def __init__(self):
            super().__init__()
            self.model, self.layer, self.length = lm.model, lm.model.layers[0].attention, length

        def construct(self, ids, q, k, v):
            mask = self.model.casual_mask(ids)
            q, k = self.layer.apply_rotary_emb(q, k, self.model.freqs_mgr(self.length))
            rep = self.layer.n_rep
            return self.layer._attn(q, self.layer._repeat_kv(k, rep), self.layer._repeat_kv(v, rep), mask)

    class Head(nn.Cell):
        """Everything outside the decoder layers: embedding, final norm, LM head on the last token."""

        def __init__(self):
            super().__init__()
            self.model, self.lm_head = lm.model, lm.lm_head

        def construct(self, ids):
            return self.lm_head(self.model.norm_out(self.model.tok_embeddings(ids))[:, -1:, :])

    attention_net, head_net = Attention(), Head()
    _, attention_times = timed(lambda: attention_net(ids, q, k, v).asnumpy(), repeats)
    _, head_times = timed(lambda: head_net(ids).asnumpy(), repeats)
    probe = lm.model.layers[0].feed_forward.w2.weight[:8].astype(ms.float32).asnumpy()
    return {"backend_ran": f"mindformers {mindformers.__version__}, mindspore {ms.__version__}", "build_s": build_s,
            "compile_s": compile_s, "ttft": stats(ttft), "attention": stats(attention_times), "head": stats(head_times),
            "weights_checksum": weights_checksum(probe), "logits_probe": probe_logits}


# ---------------------------------------------------------------------------------------------
# The generation points (child processes) and transformers' generate.

def project_generation_point(backend: str, checkpoint: str, context: int, batch: str, new_tokens: int, seed: int,
                             weight_dtype: str = "auto", compute_dtype: str = "auto", prefills: int = 0) -> dict:
    """This project's ``Generator`` in GRAPH_MODE on its in-place KV cache (``weight_dtype`` and
    ``compute_dtype`` as ``load_checkpoint`` takes them; the cache the model's default). ``prefills``
    prefills of the whole prompts (and the first token's choice) timed after the warm-up and before
    the generation, as ``llama_cpp_peer.generation_point`` times its own: ``prefill_s``."""
    import ms_rope_attention  # noqa: F401  before MindSpore, as users run it (docs/threads.md)
    import mindspore as ms

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    from models.llama.engine import Generator
    from models.llama.engine.kv_cache import bucket_capacity
    from models.llama.weights import load_checkpoint

    lm = load_checkpoint(checkpoint, backend=backend, max_positions=context + new_tokens, progress=False,
                         weight_dtype=weight_dtype, compute_dtype=compute_dtype)
    prompts = prompts_for(batch, context, lm.vocab_size, seed)
    capacity = bucket_capacity(max(map(len, prompts)) + new_tokens, lm.max_positions)
    gen = Generator(lm, slots=len(prompts), capacity=capacity)
    compile_s = gen.warm_up([p[:WARM_UP_TOKENS] for p in prompts])
    prefill_s = timed_calls(lambda: gen.prefill_logits(prompts).argmax(-1), prefills)
    result = gen.generate(prompts, new_tokens, eos_ids=())
    return {"backend_ran": lm.backend, "compute_ran": lm.compute_dtype, "compile_s": compile_s, "ttft_s": result.ttft_s,
            "step_ms": [ms_ for _, ms_ in result.step_ms], "cached_tokens": [c for c, _ in result.step_ms],
            "tokens": result.tokens, "prefill_s": prefill_s}


def hf_stamps():
    """A transformers streamer keeping the time of every ``put``: the prompt first, then each step's
    tokens (``.times``)."""
    import transformers

    class Stamps(transformers.generation.BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    return Stamps()


def hf_generate(lm, prompts, new_tokens: int, cache: str, streamer=None) -> list[list[int]]:
    """transformers' greedy ``generate`` of exactly ``new_tokens`` per prompt, the batch left-padded
    with an attention mask; ``cache`` 'dynamic' or 'static'."""
    import torch

    longest = max(map(len, prompts))
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):], mask[i, longest - len(p):] = torch.tensor(p), 1
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}
    with torch.inference_mode():
        out = lm.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, streamer=streamer, pad_token_id=0, **kwargs)
    return out[:, longest:].tolist()


def hf_generation_point(cache: str, checkpoint: str, context: int, batch: str, new_tokens: int, seed: int,
                        dtype: str = "float32", prefills: int = 0) -> dict:
    """transformers' ``generate`` (greedy, sdpa) with ``cache`` 'dynamic' or 'static', every core,
    the model in ``dtype``; ``prefills`` as ``project_generation_point`` times them (a ``generate``
    of one token each)."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    lm = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype),
                                                       attn_implementation="sdpa").eval()
    prompts = prompts_for(batch, context, lm.config.vocab_size, seed)
    start = time.perf_counter()
    hf_generate(lm, [p[:WARM_UP_TOKENS] for p in prompts], 2, cache)
    compile_s = time.perf_counter() - start
    prefill_s = timed_calls(lambda: hf_generate(lm, prompts, 1, cache), prefills)
    stamps = hf_stamps()
    start = time.perf_counter()
    tokens = hf_generate(lm, prompts, new_tokens, cache, stamps)
    times = stamps.times[1:]  # after the prompt's put: one per generated token
    return {"backend_ran": f"transformers {transformers.__version__}, torch {torch.__version__}, {cache} cache",
            "compile_s": compile_s, "ttft_s": times[0] - start, "step_ms": list(np.diff(times) * 1e3),
            "cached_tokens": [sum(map(len, prompts)) + len(prompts) * (i + 1) for i in range(len(times) - 1)],
            "tokens": tokens, "prefill_s": prefill_s}


def generation_point(system: str, **kwargs) -> dict:
    if system.startswith("hf-"):
        missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
        if missing:
            return {"status": "skipped", "error": f"not installed: {', '.join(missing)} (make bench installs them)"}
        return hf_generation_point(system[3:], **kwargs)
    return project_generation_point(system, **kwargs)
