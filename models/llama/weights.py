"""Checkpoint loading: Hugging Face (config.json + safetensors, sharded or not) and Meta's original
layout (params.json + consolidated.*), tensor by tensor, memory-mapped, with a progress bar.

Hugging Face checkpoints have their q/k projections permuted for rotate-half RoPE (rotary_mode 0).
Meta's original checkpoints are not permuted: they are loaded as they are and run with interleaved
RoPE (rotary_mode 1), which the fused kernel supports natively, so no weight is rewritten. Only a
model whose layout differs from its file's (a Meta fine-tune resumed from its Hugging Face save) has
its q/k rows reordered on load, and a save always writes Hugging Face's layout (``save_hf_checkpoint``).
Every problem (missing or unknown tensor, wrong shape or dtype, unreadable file) raises
``CheckpointError`` naming the tensor and the file. A checkpoint is untrusted input: the files an
index names must be plain file names in its directory, every file must be a regular file (a FIFO
or a device would block the load), and each tensor's shape and dtype are checked from the file's
header before its data is read (a huge but consistent header costs nothing before it is refused).
"""
from __future__ import annotations

import json
import os
import re
import stat
from contextlib import ExitStack
from pathlib import Path

import ml_dtypes  # registers numpy's bfloat16 so safetensors can hand out bf16 arrays
import mindspore as ms
import numpy as np
from mindspore import Tensor
from mindspore.nn.utils import no_init_parameters
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from .config import LlamaConfig
from .model import DTYPES, LlamaForCausalLM, dtype_name

FLOAT_DTYPES = ("float16", "float32", "float64", "bfloat16")
NUMPY_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "BOOL": "bool",
                       "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32", "I32": "int32",
                       "U64": "uint64", "I64": "int64"}  # header codes -> numpy names
_PROBE = "model.layers.0.self_attn.q_proj.weight"  # the tensor whose dtype is the checkpoint's
_FILE_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
               stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_QK = re.compile(r"\.self_attn\.[qk]_proj\.weight$")
SOURCE_ROTARY_MODE = {"hf": 0, "meta": 1}  # the RoPE layout each checkpoint format's q/k rows are in
HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # buffers some old exports carry; recomputed here
META_IGNORED = re.compile(r"^rope\.freqs$")
_META_NAMES = [
    (r"^tok_embeddings\.weight$", "model.embed_tokens.weight", 1),
    (r"^norm\.weight$", "model.norm.weight", None),
    (r"^output\.weight$", "lm_head.weight", 0),
    (r"^layers\.(\d+)\.attention\.wq\.weight$", r"model.layers.\1.self_attn.q_proj.weight", 0),
    (r"^layers\.(\d+)\.attention\.wk\.weight$", r"model.layers.\1.self_attn.k_proj.weight", 0),
    (r"^layers\.(\d+)\.attention\.wv\.weight$", r"model.layers.\1.self_attn.v_proj.weight", 0),
    (r"^layers\.(\d+)\.attention\.wo\.weight$", r"model.layers.\1.self_attn.o_proj.weight", 1),
    (r"^layers\.(\d+)\.feed_forward\.w1\.weight$", r"model.layers.\1.mlp.gate_proj.weight", 0),
    (r"^layers\.(\d+)\.feed_forward\.w2\.weight$", r"model.layers.\1.mlp.down_proj.weight", 1),
    (r"^layers\.(\d+)\.feed_forward\.w3\.weight$", r"model.layers.\1.mlp.up_proj.weight", 0),
    (r"^layers\.(\d+)\.attention_norm\.weight$", r"model.layers.\1.input_layernorm.weight", None),
    (r"^layers\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight", None),
]


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensor and file."""


def meta_to_hf_name(name: str) -> tuple[str, int | None]:
    """(Hugging Face name, dimension Meta's model-parallel shards split it along, or None if replicated)."""
    for pattern, target, dim in _META_NAMES:
        if re.match(pattern, name):
            return re.sub(pattern, target, name), dim
    raise CheckpointError(f"unknown tensor {name!r} in a Meta checkpoint")


def qk_to_rotary_mode(weight: np.ndarray, config: LlamaConfig, rotary_mode: int) -> np.ndarray:
    """A q or k projection (whole heads of rows: a tensor-parallel part too) reordered from the other
    RoPE layout into ``rotary_mode``'s: interleaved pair i, rows (2i, 2i + 1) of a head, is the
    rotate-half pair (i, i + rotary_dim / 2); rows past ``rotary_dim`` are not rotated and stay.
    For full rotary, to rotate-half is Hugging Face's conversion permutation of Meta's wq/wk."""
    rd, d = config.rotary_dim, config.dim_per_head
    to_rotate_half = np.concatenate([np.arange(0, rd, 2), np.arange(1, rd, 2), np.arange(rd, d)])
    order = to_rotate_half if rotary_mode == 0 else np.argsort(to_rotate_half)
    return weight.reshape(-1, d, *weight.shape[1:])[:, order].reshape(weight.shape)


# ---------------------------------------------------------------------------------------------
# Sources: each yields (name, file, shape, dtype, lazy array getter) without reading data until asked.

def _regular_file(path: Path, what: str) -> Path:
    """``path`` when it is a regular file (after symlinks), checked before it is opened: opening a
    FIFO blocks until a writer comes, and a device never ends."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise CheckpointError(f"{what}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        kind = _FILE_KINDS.get(stat.S_IFMT(mode), "another kind of file")
        raise CheckpointError(f"{what}: expected a regular file, got {kind}")
    return path


def _open_safetensors(path: Path):
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path.name}: not a readable safetensors file ({exc})") from None


def _read(handle, name: str, path: Path) -> np.ndarray:
    try:
        return handle.get_tensor(name)
    except (SafetensorError, OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"tensor {name!r} in {path.name}: cannot be read ({exc})") from None


def _indexed_files(directory: Path, index: Path) -> list[Path]:
    """The files ``index``'s weight_map names, each a plain file name in ``directory`` (as Hugging
    Face writes them): an absolute path, ``..`` or a subdirectory is refused, so an index cannot
    make the loader open a file outside its checkpoint. A symlink in the directory is followed
    wherever it leads (a Hugging Face hub cache snapshot is symlinks into its ``blobs/``): the
    directory's own entries are its owner's choice, while the index's names are data."""
    try:
        weight_map = json.loads(_regular_file(index, str(index)).read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map: expected an object of tensor name -> file name, "
                              f"got {type(weight_map).__name__}")
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or name in ("", "..") or "\0" in name or Path(name).name != name:
            raise CheckpointError(f"{index}: weight_map[{tensor!r}] = {name!r}: expected the name of a file in "
                                  f"{directory} (no directory part)")
    return [_regular_file(directory / name, f"{index}: weight_map file {name!r}")
            for name in sorted(set(weight_map.values()))]


def hf_files(directory: Path) -> list[Path]:
    """A Hugging Face checkpoint's safetensors files: those its index names, or else all of them."""
    index = directory / "model.safetensors.index.json"
    if index.exists() or index.is_symlink():
        return _indexed_files(directory, index)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files (and no model.safetensors.index.json)")
    return [_regular_file(path, str(path)) for path in files]


def _header(handle, name: str) -> tuple[tuple[int, ...], str]:
    """(shape, numpy dtype name) of tensor ``name`` from its file's header; nothing is read."""
    piece = handle.get_slice(name)
    code = piece.get_dtype()
    return tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(code, code)


def _read_alone(path: Path, name: str, index=None) -> np.ndarray:
    """One tensor (or its part ``index``, a tuple of slices: only that part is read), with its file
    mapped only while it is read: safetensors maps the whole file, and mapped pages count as the
    process's resident memory until the file is closed (measured loading a 2.7 GB checkpoint: 2.7 GB
    of file pages on top of the model, peak 5.5 GB instead of 3.6)."""
    with _open_safetensors(path) as handle:
        if index is None:
            return _read(handle, name, path)
        try:
            return handle.get_slice(name)[index]
        except (SafetensorError, OSError, ValueError, TypeError) as exc:
            raise CheckpointError(f"tensor {name!r} in {path.name}: cannot be read ({exc})") from None


def _hf_tensors(directory: Path):
    for path in hf_files(directory):
        with _open_safetensors(path) as handle:
            headers = [(name, *_header(handle, name)) for name in handle.keys() if not HF_IGNORED.match(name)]
        for name, shape, dtype in headers:
            yield name, path, shape, dtype, (lambda index=None, n=name, p=path: _read_alone(p, n, index))


def _meta_shards(directory: Path, stack: ExitStack) -> list[dict]:
    """Each model-parallel shard as {name: (shape, dtype, read)}, nothing read yet: safetensors files
    stay open (memory-mapped) on ``stack``; .pth files go through torch's mmap load."""
    st = [_regular_file(path, str(path)) for path in sorted(directory.glob("consolidated.*.safetensors"))]
    pth = [_regular_file(path, str(path)) for path in sorted(directory.glob("consolidated.*.pth"))]
    if st:
        shards = []
        for path in st:
            handle = stack.enter_context(_open_safetensors(path))
            shards.append({n: (*_header(handle, n), lambda h=handle, n=n, p=path: _read(h, n, p))
                           for n in handle.keys() if not META_IGNORED.match(n)})
        return shards
    if pth:
        try:
            import torch
        except ImportError:
            raise CheckpointError(f"{pth[0].name}: Meta .pth checkpoints need PyTorch to unpickle "
                                  "(pip install torch), or convert them to consolidated.NN.safetensors") from None
        shards = []
        for path in pth:
            try:
                state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
            except Exception as exc:  # torch raises many types for a corrupt file
                raise CheckpointError(f"{path.name}: not a readable PyTorch checkpoint ({exc})") from None
            shards.append({n: (tuple(t.shape), str(t.dtype).replace("torch.", ""), lambda t=t: _torch_numpy(t, torch))
                           for n, t in state.items() if not META_IGNORED.match(n)})
        return shards
    raise CheckpointError(f"{directory}: no consolidated.*.safetensors or consolidated.*.pth files")


def _torch_numpy(tensor, torch) -> np.ndarray:
    """A (memory-mapped) torch tensor as numpy, without a copy: bfloat16, which numpy lacks, through
    its bits (ml_dtypes' bfloat16 has torch's layout)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _meta_tensors(directory: Path):
    """(HF name, where, shape, dtype, read) per tensor; model-parallel shards are concatenated one
    tensor at a time."""
    with ExitStack() as stack:
        shards = _meta_shards(directory, stack)
        for name in shards[0]:
            hf_name, dim = meta_to_hf_name(name)
            for i, shard in enumerate(shards):
                if name not in shard:
                    raise CheckpointError(f"tensor {name!r} is missing from model-parallel shard {i}")
            shape, dtype, read = shards[0][name]
            if dim is not None and len(shards) > 1:
                shapes = [s[name][0] for s in shards]
                if (any(len(s) <= dim for s in shapes) or len({s[:dim] + s[dim + 1:] for s in shapes}) > 1
                        or len({s[name][1] for s in shards}) > 1):
                    raise CheckpointError(f"tensor {name!r}: model-parallel shards of shapes {shapes} and dtypes "
                                          f"{[s[name][1] for s in shards]}, expected one dtype and shapes that "
                                          f"differ only in dimension {dim}")
                shape = shape[:dim] + (sum(s[dim] for s in shapes),) + shape[dim + 1:]
                read = (lambda n=name, d=dim: np.concatenate([s[n][2]() for s in shards], axis=d))
            yield (hf_name, Path(f"consolidated.*[{name}]"), shape, dtype,
                   (lambda index=None, r=read: r() if index is None else r()[index]))


# ---------------------------------------------------------------------------------------------

def read_config(directory: str | Path) -> tuple[LlamaConfig, str]:
    """(config, "hf" | "meta") of a checkpoint directory; any problem with the file is a
    CheckpointError naming it."""
    directory = Path(directory)
    path = directory / "config.json"
    if path.exists():
        try:
            return LlamaConfig.from_file(path), "hf"
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: not a Llama config this model computes ({exc})") from None
    path = directory / "params.json"
    if path.exists():
        try:
            params = json.loads(path.read_text())
            vocab = None
            if (params.get("vocab_size") or -1) < 1:
                with ExitStack() as stack:  # the shape only: no tensor is read
                    vocab = _meta_shards(directory, stack)[0]["tok_embeddings.weight"][0][0]
            return LlamaConfig.from_meta(params, vocab), "meta"
        except CheckpointError:
            raise
        except KeyError as exc:
            raise CheckpointError(f"{path}: lacks {exc.args[0]!r}") from None
        except (json.JSONDecodeError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{path}: not a Llama params.json ({exc})") from None
    raise CheckpointError(f"{directory}: neither config.json (Hugging Face) nor params.json (Meta) found")


def load_weights(model: LlamaForCausalLM, directory: str | Path, source: str = "hf", progress: bool = True,
                 first_layers_only: bool = False) -> None:
    """Copy a checkpoint into ``model``'s parameters, each tensor converted to its parameter's dtype
    only when they differ (and q/k to the model's RoPE layout, when the checkpoint's differs).

    ``first_layers_only``: the model deliberately has fewer layers than the checkpoint (benchmarks);
    tensors of the layers beyond are skipped instead of being reported as unknown."""
    directory = Path(directory)
    params = model.parameters_dict()
    expected = set(params)
    tp = model.tensor_parallel  # a tensor-parallel rank reads its part of each tensor only
    tied = model.config.tie_word_embeddings
    tensors = _hf_tensors(directory) if source == "hf" else _meta_tensors(directory)
    loaded = set()
    for name, path, shape, dtype, get in tqdm(tensors, desc=f"loading {directory.name}", unit="tensor",
                                              disable=not progress, total=len(expected)):
        if tied and name == "lm_head.weight":
            continue  # tied: the output projection is the embedding, whatever copy the file carries
        layer = _LAYER.match(name)
        if first_layers_only and layer and int(layer.group(1)) >= model.config.num_hidden_layers:
            continue
        if name not in expected:
            raise CheckpointError(f"unknown tensor {name!r} in {path.name}: the model has no such parameter "
                                  f"(config: {model.config.num_hidden_layers} layers)")
        index = tp.index(name, model.config) if tp else None
        part = shape if index is None else _part_shape(shape, index)
        param = params[name]
        if part != tuple(param.shape):
            raise CheckpointError(f"tensor {name!r} in {path.name}: shape {part}, expected {tuple(param.shape)}")
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {path.name}: dtype {dtype}, expected one of "
                                  f"{list(FLOAT_DTYPES)}")
        if name in loaded:
            raise CheckpointError(f"tensor {name!r} appears twice (again in {path.name})")
        array = get(index)
        if _QK.search(name) and SOURCE_ROTARY_MODE[source] != model.config.rotary_mode:
            array = qk_to_rotary_mode(array, model.config, model.config.rotary_mode)
        param.set_data(Tensor(_as_dtype(array, dtype_name(param.dtype))))
        loaded.add(name)
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{directory}: missing tensor(s) {shown}")


def _part_shape(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[int, ...]:
    """The shape of ``index`` (a tensor-parallel rank's slices) of a tensor of ``shape``."""
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape)) + shape[len(index):]


def _as_dtype(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` in ``dtype`` (a numpy name), converted directly (no float32 copy on the way) and
    only when it differs."""
    if str(array.dtype) == "bfloat16":  # ml_dtypes' or MindSpore's own numpy bfloat16: one layout, two types
        array = array.view(np.uint16).view(NUMPY_DTYPES["bfloat16"])
    target = NUMPY_DTYPES[dtype]
    return array if array.dtype == target else array.astype(target)


def checkpoint_dtype(directory: str | Path) -> str:
    """The dtype a checkpoint's weights are stored in ('float16', 'bfloat16', 'float32' or
    'float64'): its first layer's q projection's, read from the file headers (no tensor is read)."""
    directory = Path(directory)
    _, source = read_config(directory)
    if source == "hf":
        for path in hf_files(directory):
            with _open_safetensors(path) as handle:
                if _PROBE in handle.keys():
                    return _SAFETENSORS_DTYPES.get(handle.get_slice(_PROBE).get_dtype(), "float32")
        raise CheckpointError(f"{directory}: no tensor {_PROBE!r}")
    with ExitStack() as stack:
        shard = _meta_shards(directory, stack)[0]
        if "layers.0.attention.wq.weight" not in shard:
            raise CheckpointError(f"{directory}: no tensor 'layers.0.attention.wq.weight'")
        return shard["layers.0.attention.wq.weight"][1]


def default_weight_dtype(directory: str | Path, dtype: str) -> str:
    """``load_checkpoint``'s ``weight_dtype="auto"``: a float16 / bfloat16 checkpoint keeps its own
    precision under float32 activations on the CPU (the projection and embedding ops convert it
    exactly); anything else takes the activations' dtype."""
    if dtype_name(dtype) != "float32" or ms.get_context("device_target") != "CPU":
        return dtype_name(dtype)
    stored = checkpoint_dtype(directory)
    return stored if stored in ("float16", "bfloat16") else "float32"


def load_checkpoint(directory: str | Path, *, dtype: str = "float32", layout: str = "BSH", backend: str = "auto",
                    logits: str = "all", max_positions: int | None = None, num_layers: int | None = None,
                    progress: bool = True, projections: str = "auto", parallel=None,
                    weight_dtype: str = "auto", compute_dtype: str = "auto") -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` built from a checkpoint's config and filled with its weights
    (only the first ``num_layers`` decoder layers when given).

    ``weight_dtype``: "auto" keeps a float16 / bfloat16 checkpoint's weights in their own precision
    on the CPU (``dtype`` float32: float32 activations and arithmetic, the weights in half the
    memory, each read straight into its parameter with no float32 copy); "float32" (or any dtype)
    converts them on load. Norm weights always take ``dtype``. ``compute_dtype``: the CPU ops'
    arithmetic (``LlamaForCausalLM``; "auto": bfloat16 for a bfloat16 checkpoint where this CPU has
    native instructions for it)."""
    config, source = read_config(directory)
    weight_dtype = default_weight_dtype(directory, dtype) if weight_dtype == "auto" else dtype_name(weight_dtype)
    if num_layers is not None:
        if not 0 < num_layers <= config.num_hidden_layers:
            raise ValueError(f"num_layers: expected 1..{config.num_hidden_layers}, got {num_layers!r}")
        config = config.replace(num_hidden_layers=num_layers)
    # Every weight comes from the checkpoint: skip the random initialisation (for 2 layers of Llama2-7B
    # it took 25 of the 30 s of a load, and held a second copy of the weights until they were replaced).
    with no_init_parameters():
        model = LlamaForCausalLM(config, dtype=dtype, layout=layout, backend=backend, logits=logits,
                                 max_positions=max_positions, projections=projections, parallel=parallel,
                                 weight_dtype=weight_dtype, compute_dtype=compute_dtype)
    load_weights(model, directory, source, progress, first_layers_only=num_layers is not None)
    return model


def model_state(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """Parameters as float32 numpy arrays under their Hugging Face names."""
    return {name: p.astype(DTYPES["float32"]).asnumpy() for name, p in model.parameters_dict().items()}


def save_hf_checkpoint(state: dict[str, np.ndarray], config: LlamaConfig, directory: str | Path,
                       max_shard_bytes: int | None = None) -> Path:
    """Write ``state`` as a Hugging Face checkpoint (config.json, safetensors, an index when sharded).
    ``state`` is in ``config``'s RoPE layout; interleaved q/k (a model loaded from Meta's layout) are
    written in Hugging Face's rotate-half layout, which config.json implies, so the directory loads,
    here and in transformers, to the logits of the model that was saved."""
    if config.rotary_mode == 1:
        state = {name: qk_to_rotary_mode(array, config, 0) if _QK.search(name) else array
                 for name, array in state.items()}
        config = config.replace(rotary_mode=0)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
    shards, current, size = [], {}, 0
    for name, array in state.items():
        if max_shard_bytes and current and size + array.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = np.ascontiguousarray(array)
        size += array.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"))
        return directory
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file))
        weight_map.update({name: file for name in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def gathered_state(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The full float32 weights of a tensor-parallel model (every rank of its tensor-parallel group
    calls it; every rank gets them), as ``weights.model_state`` gives them for one process."""
    tp, config = model.tensor_parallel, model.config
    return {name: tp.gather(name, param, config) for name, param in model.parameters_dict().items()}


def scatter_state(model: LlamaForCausalLM, state: dict[str, np.ndarray]) -> None:
    """Fill a tensor-parallel model with its slices of one process's full weights ``state``."""
    tp, config = model.tensor_parallel, model.config
    for name, param in model.parameters_dict().items():
        index = tp.index(name, config)
        param.set_data(Tensor(np.ascontiguousarray(state[name] if index is None else state[name][index]),
                              param.dtype))
