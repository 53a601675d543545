"""llama.cpp (llama-cpp-python) as a peer of the half-weights benchmark, on the same weights: the
Hugging Face checkpoint the other systems read, written as bf16 and f16 GGUF files with the ``gguf``
package's writer (``write_gguf``), and llama.cpp's prefill and decode timed on them
(``generation_point``), token ids fed directly (the GGUF's vocabulary only names the ids).

Per full layer: llama.cpp computes the last layer's attention output and MLP only for the tokens
whose logits it returns (one here), so its prefill of an L-layer model is the embedding and LM head,
L - 1 full layers and one pruned layer. ``write_gguf`` also writes the checkpoint with one layer
more (its layers repeated: the same shapes, the same work), ``generation_point`` times the two
models' prefills alternating, and a full layer is the difference of their times (min - min;
median - median and each pair of neighbouring calls in the JSON).

Runs in llama.cpp's own virtual environment (``make llama-cpp``: .venv-llamacpp, built from the
source distribution for this CPU; benchmarks/peers/llama_cpp.txt), under ``harness.run_isolated``:
this module imports only numpy and the benchmarks' shared modules at the top.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from harness import cpu_flags, turned
from peers import WARM_UP_TOKENS, logits_probe, prompts_for

PYTHON = Path(__file__).resolve().parent.parent / ".venv-llamacpp" / "bin" / "python"
TENSOR_TYPES = ("bf16", "f16")
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: Llama 2's unknown, begin and end of sequence


def vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a minimal SentencePiece-style ("llama") vocabulary of ``size``
    ids: Llama 2's three special tokens, its 256 byte tokens where there is room, then one named
    token per remaining id. llama.cpp needs a vocabulary in the file; the benchmark feeds ids, so
    nothing is ever tokenized with it."""
    import gguf

    if size < len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size: expected at least {len(SPECIAL_TOKENS)}, got {size}")
    kinds = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens, types = list(SPECIAL_TOKENS), [int(k) for k in kinds]
    if size >= len(SPECIAL_TOKENS) + 256:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [int(gguf.TokenType.BYTE)] * 256
    named = size - len(tokens)
    tokens += [f"\u2581t{i}" for i in range(len(tokens), size)]
    types += [int(gguf.TokenType.NORMAL)] * named
    return tokens, [0.0] * size, types


def tokenizer_vocabulary(path: str, size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of the Hugging Face ``tokenizer.json`` at ``path``, a vocabulary of
    ``size`` single characters and special tokens without merges (``peers.write_char_tokenizer``):
    the same ids and texts in the GGUF file, where llama.cpp's SentencePiece-style tokenizer, finding
    no token longer than a character, splits a text into the same ids as the ``tokenizers`` one.
    Read as JSON: llama.cpp's environment has no ``tokenizers``."""
    import gguf

    spec = json.loads(Path(path).read_text())
    model = spec.get("model", {})
    if model.get("type") != "BPE" or model.get("merges"):
        raise ValueError(f"tokenizer: expected a BPE vocabulary without merges (peers.write_char_tokenizer); "
                         f"{path} has a {model.get('type')} model with {len(model.get('merges') or [])} merges")
    by_id = {int(i): t for t, i in model["vocab"].items()}
    if sorted(by_id) != list(range(size)):
        raise ValueError(f"tokenizer: expected ids 0..{size - 1} (the checkpoint's vocab_size); {path} has "
                         f"{len(by_id)} ids from {min(by_id, default=None)} to {max(by_id, default=None)}")
    special = {int(t["id"]) for t in spec.get("added_tokens", []) if t.get("special")}
    unk = model.get("unk_token")
    tokens = [by_id[i] for i in range(size)]
    types = [int(gguf.TokenType.UNKNOWN if t == unk else gguf.TokenType.CONTROL if i in special
                 else gguf.TokenType.NORMAL) for i, t in enumerate(tokens)]
    return tokens, [0.0] * size, types


def rotate_half_to_pairs(weight: np.ndarray, heads: int) -> np.ndarray:
    """q/k projection rows from Hugging Face's rotate-half RoPE layout (per head: the first halves of
    the rotated pairs, then the second halves) to llama.cpp's Llama layout (adjacent pairs)."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _checkpoint_tensors(checkpoint: Path) -> dict:
    """name -> the safetensors file holding it, over every shard of ``checkpoint``."""
    from safetensors import safe_open

    where = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as f:
            where.update({name: file for name in f.keys()})
    if not where:
        raise FileNotFoundError(f"checkpoint: no *.safetensors in {checkpoint}")
    return where


def _read_tensor(file: Path, name: str) -> np.ndarray:
    from safetensors import safe_open

    with safe_open(str(file), framework="np") as f:  # bfloat16 tensors come as ml_dtypes.bfloat16
        return f.get_tensor(name)


def write_gguf(checkpoint: str, path: str, tensor_type: str, layers: int | None = None,
               tokenizer: str | None = None) -> dict:
    """The Llama checkpoint at ``checkpoint`` (a Hugging Face directory: config.json and safetensors)
    as a GGUF file at ``path``: matrices in ``tensor_type`` ("bf16" or "f16", rounded to nearest even
    from the checkpoint's values), norm weights in float32 (llama.cpp's convention), q/k rows in
    llama.cpp's RoPE layout, the config as Llama metadata, a minimal vocabulary (``vocabulary``), or
    the vocabulary of ``tokenizer`` (a ``tokenizer.json`` of one character per token,
    ``peers.write_char_tokenizer``: ``tokenizer_vocabulary``) for a server that tokenizes text.
    ``layers`` (default: the checkpoint's) blocks, block i from the checkpoint's layer i mod its
    layers. Returns the file's path, size and layer count."""
    import gguf

    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor_type: expected one of {TENSOR_TYPES}, got {tensor_type!r}")
    checkpoint = Path(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    unsupported = {key: config[key] for key in ("rope_scaling", "attention_bias", "mlp_bias")
                   if config.get(key)}
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        unsupported["partial_rotary_factor"] = config["partial_rotary_factor"]
    if unsupported:
        raise ValueError(f"checkpoint: write_gguf converts plain Llama configs; {checkpoint} has {unsupported}")
    source_layers = config["num_hidden_layers"]
    layers = source_layers if layers is None else layers
    if layers < 1:
        raise ValueError(f"layers: expected a positive count, got {layers}")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "f16": gguf.GGMLQuantizationType.F16}[tensor_type]

    # Tensors spooled to a temporary file as they are converted: a deep model is never whole in memory.
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA], use_temp_file=True)
    writer.add_name(f"{checkpoint.name} ({layers} layers, {tensor_type})")
    writer.add_file_type({"bf16": gguf.LlamaFileType.MOSTLY_BF16, "f16": gguf.LlamaFileType.MOSTLY_F16}[tensor_type])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    if tokenizer is None:
        tokens, scores, types = vocabulary(config["vocab_size"])
    else:
        tokens, scores, types = tokenizer_vocabulary(tokenizer, config["vocab_size"])
        writer.add_add_space_prefix(False)  # the tokenizer puts no space before a text; nor may llama.cpp
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(config.get("bos_token_id", 1))
    writer.add_eos_token_id(config.get("eos_token_id", 2))

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    where = _checkpoint_tensors(checkpoint)
    layer_prefix = "model.layers."
    plan = []  # (the checkpoint's tensor, the name it is written under)
    for name in where:
        if name.startswith(layer_prefix):
            index, rest = name[len(layer_prefix):].split(".", 1)
            plan += [(name, f"{layer_prefix}{i}.{rest}") for i in range(layers) if i % source_layers == int(index)]
        elif not name.endswith("rotary_emb.inv_freq"):
            plan.append((name, name))
    for source, target in sorted(plan, key=lambda p: p[1]):
        gguf_name = names.get_name(target, try_suffixes=(".weight",))
        if gguf_name is None:
            raise ValueError(f"checkpoint: {source} in {where[source]} has no llama GGUF name")
        array = _read_tensor(where[source], source).astype(np.float32)
        if source.endswith("self_attn.q_proj.weight"):
            array = rotate_half_to_pairs(array, heads)
        elif source.endswith("self_attn.k_proj.weight"):
            array = rotate_half_to_pairs(array, kv_heads)
        if array.ndim == 1:
            writer.add_tensor(gguf_name, array)
        else:
            data = gguf.quantize(array, qtype)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"path": path, "bytes": os.path.getsize(path), "layers": layers, "tensor_type": tensor_type}


def write_gguf_pair(checkpoint: str, directory: str, tensor_type: str) -> dict:
    """The checkpoint as ``tensor_type`` GGUF files in ``directory``: its own depth ("model") and one
    layer deeper ("deeper_model", for the per-full-layer difference)."""
    layers = json.loads((Path(checkpoint) / "config.json").read_text())["num_hidden_layers"]
    files = {key: write_gguf(checkpoint, os.path.join(directory, f"model-{tensor_type}-{n}.gguf"), tensor_type, n)
             for key, n in (("model", layers), ("deeper_model", layers + 1))}
    return {"model": files["model"]["path"], "deeper_model": files["deeper_model"]["path"],
            "bytes": files["model"]["bytes"], "layers": layers}


def tokenize_point(model: str, texts: list[str]) -> dict:
    """llama.cpp's token ids of each text (no BOS, special-token texts not parsed) and the texts it
    decodes them back to, from the GGUF ``model``'s vocabulary alone: the load benchmark's check that
    llama.cpp splits a prompt into the ids the server's tokenizer does."""
    import llama_cpp

    lm = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    ids = [lm.tokenize(text.encode(), add_bos=False, special=False) for text in texts]
    return {"ids": ids, "texts": [lm.detokenize(i).decode(errors="replace") for i in ids],
            "version": llama_cpp.__version__, "system_info": system_info()}


def system_info() -> str:
    """llama.cpp's own description of what it was built with (``AVX512_BF16 = 1`` and so on)."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode()


def check_native_build(info: str) -> None:
    """Refuse a llama.cpp built without the bfloat16 dot products this CPU has: its bf16 numbers
    would measure the build, not llama.cpp."""
    if "avx512_bf16" in cpu_flags() and "AVX512_BF16 = 1" not in info:
        raise RuntimeError("llama.cpp was built without AVX512_BF16 on a CPU that has it (system info: "
                           f"{info.strip()}); rebuild it with GGML_NATIVE on: rm -r .venv-llamacpp; make llama-cpp")


def generation_point(model: str, deeper_model: str, context: int, new_tokens: int, seed: int,
                     threads: int | None = None, repeats: int = 3, flash_attn: bool = True) -> dict:
    """llama.cpp on the GGUF ``model`` (and ``deeper_model``, one layer more): after a warm-up on the
    prompt cut to peers.WARM_UP_TOKENS, ``repeats`` prefills of the ``context``-token prompt on each
    model alternating (per full layer: the difference of their min, of their median, and of each pair
    of neighbouring calls), then a greedy generation of ``new_tokens`` on ``model``: TTFT (prefill and
    the first token's choice) and each decode step. ``threads`` (default: the CPUs of this process)
    for prefill and decode; the prompt in one llama_decode call (n_batch = its length, llama.cpp's
    default micro-batch of 512); ``flash_attn`` on is what llama.cpp's own default ("auto") picks on
    a CPU."""
    import gguf
    import llama_cpp

    info = system_info()
    check_native_build(info)
    threads = threads or len(os.sched_getaffinity(0))
    load_start = time.perf_counter()
    lms = {}
    for path in (model, deeper_model):
        lm = llama_cpp.Llama(path, n_ctx=context + new_tokens, n_batch=context, n_threads=threads,
                             n_threads_batch=threads, flash_attn=flash_attn, seed=seed, verbose=False)
        lms[int(lm.metadata["llama.block_count"])] = lm
    build_s = time.perf_counter() - load_start
    layers, deeper = sorted(lms)
    if deeper != layers + 1:
        raise ValueError(f"deeper_model: expected {layers + 1} layers (model has {layers}), got {deeper}")
    vocab = lms[layers].n_vocab()
    prompt = prompts_for("1", context, vocab, seed)[0]

    def last_logits(lm) -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lm.ctx, -1), shape=(vocab,)).copy()

    def prefill(lm, ids) -> np.ndarray:
        lm.reset()  # the next eval starts at position 0 and drops the cached keys
        lm.eval(ids)
        return last_logits(lm)

    start = time.perf_counter()
    for lm in lms.values():
        prefill(lm, prompt[:WARM_UP_TOKENS])
    compile_s = time.perf_counter() - start
    prefill_s = {n: [] for n in lms}
    for i in range(repeats):
        for n in turned(list(lms), i):
            start = time.perf_counter()
            int(prefill(lms[n], prompt).argmax())
            prefill_s[n].append(time.perf_counter() - start)

    lm = lms[layers]
    start = time.perf_counter()
    logits = prefill(lm, prompt)
    tokens = [int(logits.argmax())]
    ttft_s = time.perf_counter() - start
    step_ms = []
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        lm.eval(tokens[-1:])
        tokens.append(int(last_logits(lm).argmax()))
        step_ms.append((time.perf_counter() - start) * 1e3)

    full_layer = {f"{name}_s": stat(prefill_s[deeper]) - stat(prefill_s[layers])
                  for name, stat in (("min", min), ("median", statistics.median))}
    full_layer["pairs_s"] = [d - s for d, s in zip(prefill_s[deeper], prefill_s[layers])]  # neighbouring calls
    file_type = gguf.LlamaFileType(int(lm.metadata["general.file_type"])).name
    return {"backend_ran": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}), {file_type}, {threads} threads, "
                           f"flash attention {'on' if flash_attn else 'off'}",
            "build_s": build_s, "compile_s": compile_s, "ttft_s": ttft_s, "step_ms": step_ms,
            "cached_tokens": [context + i for i in range(len(step_ms))], "tokens": tokens,
            "logits_probe": logits_probe(logits[None]), "layers": layers,
            "prefill_s": {str(n): times for n, times in prefill_s.items()}, "per_full_layer_s": full_layer,
            "system_info": info, "threads": threads, "file_type": file_type, "flash_attn": flash_attn,
            "versions": {"llama_cpp_python": llama_cpp.__version__, "gguf": _version("gguf"),
                         "numpy": np.__version__},
            "method": (f"TTFT: the prefill of {context} token ids in one llama_decode call (n_batch {context}, "
                       f"micro-batch 512) and the argmax of the last token's logits, after a warm-up on "
                       f"{WARM_UP_TOKENS} tokens; decode: one llama_decode of one token and its argmax per step. "
                       f"Per full layer: {repeats} prefills each of the {layers}- and {deeper}-layer files "
                       f"(the checkpoint's layers repeated), alternating; the difference of their min, of their "
                       f"median and of each pair (llama.cpp prunes the last layer to the tokens whose logits it "
                       f"returns).")}


def _version(distribution: str) -> str:
    from importlib.metadata import version

    return version(distribution)
