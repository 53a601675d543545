"""Fine-tune a Llama preset or checkpoint on a text or jsonl file, through the fused RoPE attention.

    python -m models.llama.train --model tiny --data corpus.txt --steps 200 --out runs/tiny
    python -m models.llama.train --checkpoint DIR --data data.jsonl --seq-len 512 --packing varlen
    python -m models.llama.train ... --out runs/tiny --resume     # go on from the last checkpoint

Data: a ``.txt`` file is one document per non-empty line; a ``.jsonl`` file one JSON object with a
``"text"`` field per line. Documents are tokenized with the checkpoint's tokenizer (or, for models
with a vocabulary of 256..512 and no tokenizer, UTF-8 bytes), and packed whole:
- ``fixed``: rows of ``--seq-len`` tokens (BSH), padding ignored by the loss;
- ``varlen``: up to ``--batch-size * --seq-len`` tokens of whole documents per batch (TND, no
  padding, attention never crosses documents); one graph for every batch size (dynamic shapes).
Training: AdamW, linear warm-up then cosine decay, global-norm gradient clipping, gradient
accumulation, a tqdm bar with loss and tokens/s.

Under msrun (``python -m ms_rope_attention.distributed.launch --workers 4 -m models.llama.train
--tensor-parallel 2 ...``, docs/distributed.md) the ranks form a data x context x tensor grid:
``--tensor-parallel T`` splits the model's heads, MLP and vocabulary over T ranks,
``--context-parallel C`` every sequence over C ranks (fixed packing), and the ranks left over
(``--data-parallel`` alone: all of them) each train on their share of every batch. Gradients are
summed over the ranks holding the same weights with MindSpore's ``DistributedGradReducer`` (each
rank's weighted by its share of the batch's scored tokens, so the step equals one process's on the
whole batch); gradient clipping takes the norm of the whole model. Rank 0 writes the checkpoints
(weights and optimizer state gathered whole, so a run resumes under any split). Checkpoints (``--save-every``, at
the end, and on SIGINT / SIGTERM: the ranks stop after the same step and save it) are Hugging Face
safetensors directories that ``models.llama.generate --checkpoint`` loads, plus the optimizer state
for ``--resume``; they are written so that a kill never breaks one (models/llama/run_directory.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from .config import LlamaConfig, preset
from .losses import IGNORE_INDEX, ContextParallelTraining, LlamaForTraining, context_parallel_batch
from .model import LlamaForCausalLM
from . import run_directory
from .tokenizer import Tokenizer
from .weights import (CheckpointError, gathered_state, load_weights, model_state, read_config, save_hf_checkpoint,
                      scatter_state)

_MOMENTS = ("adam_m.", "adam_v.")  # AdamWeightDecay's moment parameters: prefix + the weight's name
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
TRAINER_STATE = "trainer.json"
# The arguments that decide which batches the steps consume (with the data file's sha256): a resume
# replays the finished steps' batches to skip them, so they must not change.
REPLAY_ARGS = ("seq_len", "batch_size", "packing", "accumulate", "seed", "model", "checkpoint")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as token ids: the fallback for tiny models without a tokenizer."""

    def __init__(self):
        super().__init__(lambda text: list(text.encode("utf-8")), lambda ids: bytes(i % 256 for i in ids).decode(
            "utf-8", errors="replace"), None)


def make_tokenizer(config: LlamaConfig, checkpoint: str | None) -> Tokenizer:
    tokenizer = Tokenizer.from_directory(checkpoint, config.bos_token_id) if checkpoint else None
    if tokenizer is not None:
        return tokenizer
    if 256 <= config.vocab_size <= 512:
        return ByteTokenizer()
    where = f"{checkpoint} has no tokenizer.json or tokenizer.model" if checkpoint else "a preset has no tokenizer"
    raise ValueError(f"tokenizer: {where}, and the byte-level fallback needs a vocabulary of 256..512 "
                     f"(this model has {config.vocab_size})")


def read_documents(path: str | Path, tokenizer: Tokenizer, seq_len: int, eos_id: int | None,
                   vocab_size: int) -> list[list[int]]:
    """Token ids of every document; a clear error for an empty file, a bad jsonl line, a token id
    outside the model's vocabulary (a tokenizer that does not match the model), or a document
    longer than the context."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data: {path} is not a file")
    docs = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"data: {path}:{number}: expected a JSON object with a \"text\" field") from None
            else:
                text = line.rstrip("\n")
            ids = tokenizer.encode(text) + ([eos_id] if eos_id is not None else [])
            outside = [i for i in ids if not 0 <= i < vocab_size]
            if outside:
                raise ValueError(f"data: {path}:{number}: token id {outside[0]} is outside the model's vocabulary "
                                 f"0..{vocab_size - 1}: the tokenizer does not match the model")
            if len(ids) > seq_len:
                raise ValueError(f"data: {path}:{number}: {len(ids)} tokens, longer than the context --seq-len "
                                 f"{seq_len}; split the line or raise --seq-len")
            docs.append(ids)
    if not docs:
        raise ValueError(f"data: {path} has no documents (empty file)")
    return docs


def batches(docs: list[list[int]], packing: str, batch_size: int, seq_len: int, seed: int):
    """An endless, reproducible stream of (input_ids, labels, actual_seq_qlen or None) numpy batches:
    each epoch shuffles the documents with seed + epoch and packs them whole."""
    epoch = 0
    while True:
        order = np.random.default_rng(seed + epoch).permutation(len(docs))
        rows, row, used = [], [], 0
        for index in order:  # greedy packing of whole documents into rows of seq_len tokens
            if used + len(docs[index]) > seq_len:
                rows.append(row)
                row, used = [], 0
            row.append(docs[index])
            used += len(docs[index])
        rows.append(row)
        if len(rows) < batch_size:  # no batch in any epoch: the loop would never yield
            raise ValueError(f"data: the {len(docs)} documents pack into {len(rows)} rows of --seq-len {seq_len} "
                             f"tokens, fewer than --batch-size {batch_size}; lower --batch-size or add data")
        for start in range(0, len(rows) - batch_size + 1, batch_size):
            group = rows[start:start + batch_size]
            if packing == "fixed":
                ids = np.zeros((batch_size, seq_len), np.int32)
                labels = np.full((batch_size, seq_len), IGNORE_INDEX, np.int32)
                for b, r in enumerate(group):
                    flat = [t for doc in r for t in doc]
                    ids[b, :len(flat)] = flat
                    labels[b, :len(flat)] = flat
                yield ids, labels, None
            else:
                seqs = [doc for r in group for doc in r]
                flat = np.array([t for doc in seqs for t in doc], np.int32)
                labels = flat.copy()
                ends = np.cumsum([len(doc) for doc in seqs]).astype(np.int64)
                labels[np.concatenate([[0], ends[:-1]])] = IGNORE_INDEX  # no sequence predicts the next's start
                yield flat, labels, ends
        epoch += 1


def learning_rates(steps: int, peak: float, warmup: int, min_ratio: float) -> np.ndarray:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to ``peak * min_ratio``."""
    lrs = []
    for step in range(steps):
        if step < warmup:
            lrs.append(peak * (step + 1) / warmup)
        else:
            progress = (step - warmup) / max(1, steps - warmup)
            lrs.append(peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))))
    return np.asarray(lrs, np.float32)


def data_parallel_share(batch, rank: int, size: int):
    """This rank's part of a batch (rows ``rank::size``, or whole sequences of a packed batch) and
    its share of the batch's scored tokens: (ids, labels, ends, share)."""
    ids, labels, ends = batch
    if size == 1:
        return ids, labels, ends, 1.0
    if ends is None:
        if len(ids) % size:
            raise ValueError(f"--batch-size {len(ids)}: expected a multiple of the {size} data-parallel ranks")
        scored = int((labels[:, 1:] != IGNORE_INDEX).sum())
        ids, labels = ids[rank::size], labels[rank::size]
        return ids, labels, None, int((labels[:, 1:] != IGNORE_INDEX).sum()) / max(1, scored)
    starts = np.concatenate([[0], ends[:-1]])
    if len(ends) < size:
        raise ValueError(f"data: a packed batch of {len(ends)} documents cannot feed {size} data-parallel ranks; "
                         f"raise --batch-size or --seq-len")
    scored = int((labels[1:] != IGNORE_INDEX).sum())
    mine = range(rank, len(ends), size)
    ids = np.concatenate([ids[starts[i]:ends[i]] for i in mine])
    labels = np.concatenate([labels[starts[i]:ends[i]] for i in mine])
    ends = np.cumsum([ends[i] - starts[i] for i in mine]).astype(np.int64)
    return ids, labels, ends, int((labels[1:] != IGNORE_INDEX).sum()) / max(1, scored)


class LossAndGrads(nn.Cell):
    """One micro-batch: the loss and the gradients of the trainable weights (one compiled graph).
    ``extra``: a packed batch's ``actual_seq_qlen``, or a context-parallel part's scored-token count."""

    def __init__(self, net: nn.Cell, weights):
        super().__init__()
        self.value_and_grad = ms.value_and_grad(net, None, weights)

    def construct(self, input_ids, labels, extra=None):
        return self.value_and_grad(input_ids, labels, extra)


def clip_by_global_norm(grads, clip: float, copies, tensor_parallel_sum=None):
    """``grads`` scaled by clip / max(norm, clip), the norm over the *whole* model: with tensor
    parallelism each rank holds a part of it, so the squares are summed over the group, a tensor
    that ``copies[i]`` ranks hold alike counted once."""
    squares = sum((g.astype(ms.float32) ** 2).sum() / n for g, n in zip(grads, copies))
    if tensor_parallel_sum is not None:
        squares = tensor_parallel_sum.all_reduce(squares)
    norm = ops.sqrt(squares)
    scale = clip / ops.maximum(norm, clip)
    return tuple(g * scale.astype(g.dtype) for g in grads)


class Trainer:
    """Model, optimizer and the compiled step; ``save``/``restore`` a checkpoint directory. On a
    ``ParallelMesh`` (``lm.parallel``) each data-parallel rank takes its share of a batch, each
    context-parallel rank its part of every sequence, and the gradients are summed over the ranks
    that hold the same weights before the optimizer."""

    def __init__(self, lm: LlamaForCausalLM, args):
        from ms_rope_attention.distributed import GroupCollective, ParallelMesh

        self.lm, self.args = lm, args
        self.mesh = lm.parallel or ParallelMesh.single()
        self.context_parallel = self.mesh.context.size > 1
        if self.context_parallel:
            if args.packing != "fixed":
                raise ValueError("--context-parallel: needs --packing fixed (each rank holds two chunks of every row)")
            self.net = ContextParallelTraining(lm)
        else:
            self.net = LlamaForTraining(lm)
        if args.amp != "O0":
            from mindspore import amp
            amp.auto_mixed_precision(self.net, args.amp)
        weights = self.net.trainable_params()
        lrs = learning_rates(args.steps, args.lr, args.warmup, args.min_lr_ratio)
        self.optimizer = nn.AdamWeightDecay(weights, learning_rate=Tensor(lrs), weight_decay=args.weight_decay)
        self.step_fn = LossAndGrads(self.net, self.optimizer.parameters)
        tp = lm.tensor_parallel
        self.copies = [tp.copies(p.name, lm.config) if tp else 1 for p in self.optimizer.parameters]
        self.tensor_parallel_sum = tp.collective if tp else None
        replicas = self.mesh.replicas
        if replicas.size > 1:
            group = {} if replicas.group is None else {"group": replicas.group}
            self.reducer = nn.DistributedGradReducer(self.optimizer.parameters, mean=False, degree=replicas.size,
                                                     **group)
            self.sum_over_replicas = GroupCollective(replicas.rank, replicas.size, replicas.group)
        if args.packing == "varlen":
            self.step_fn.set_inputs(Tensor(shape=[None], dtype=ms.int32), Tensor(shape=[None], dtype=ms.int32),
                                    Tensor(shape=[None], dtype=ms.int64))
        self.step = 0
        self.saved_step = None  # the step of the checkpoint this run last wrote or resumed from

    def _inputs(self, ids, labels, ends):
        """The step's inputs for this rank's share of a batch."""
        if not self.context_parallel:
            return Tensor(ids), Tensor(labels), None if ends is None else Tensor(ends)
        context = self.mesh.context
        part_ids, part_targets, scored = context_parallel_batch(ids, labels, context.rank, context.size)
        return Tensor(part_ids), Tensor(part_targets), Tensor(max(1, scored), ms.int32)

    def train_step(self, micro_batches) -> float:
        """One optimizer step over ``micro_batches`` (gradient accumulation): mean loss. Each
        micro-batch is (ids, labels, ends) of the whole batch; a data-parallel rank takes its share."""
        total, grads = 0.0, None
        data = self.mesh.data
        for batch in micro_batches:
            ids, labels, ends, share = data_parallel_share(batch, data.rank, data.size)
            loss, g = self.step_fn(*self._inputs(ids, labels, ends))
            if data.size > 1:  # this rank's share of the batch's mean
                loss, g = loss * share, tuple(x * share for x in g)
            total += float(loss.asnumpy())
            grads = g if grads is None else tuple(a + b for a, b in zip(grads, g))
        if self.mesh.replicas.size > 1:
            grads = self.reducer(grads)
            total = float(self.sum_over_replicas.all_reduce(Tensor(np.float32(total))).asnumpy())
        if len(micro_batches) > 1:
            grads = tuple(g / len(micro_batches) for g in grads)
        if self.args.clip > 0:
            grads = clip_by_global_norm(grads, self.args.clip, self.copies, self.tensor_parallel_sum)
        self.optimizer(grads)
        self.step += 1
        return total / len(micro_batches)

    def _whole_moment(self, name: str, tensor) -> np.ndarray:
        """An AdamW moment (``adam_m.<weight>``) whole: gathered over tensor parallelism as its weight is."""
        tp = self.lm.tensor_parallel
        if tp is None:
            return tensor.astype(ms.float32).asnumpy()
        return tp.gather(name.split(".", 1)[1], tensor, self.lm.config)

    def save(self, out: Path, config: LlamaConfig, checkpoint: str | None, replay: dict) -> Path:
        """out/step-N: HF safetensors + config (for generate) + optimizer state + trainer.json (the
        step, the arguments, ``replay``); out/latest names it (atomically: run_directory.save). A
        step already saved is not saved again. Every rank gathers the weights and moments of its
        tensor-parallel group; rank 0 writes."""
        name = f"step-{self.step}"
        if self.saved_step == self.step:
            return out / name
        self.saved_step = self.step
        weights = gathered_state(self.lm) if self.lm.tensor_parallel else model_state(self.lm)
        moments = {name: self._whole_moment(name, p) for name, p in self.optimizer.parameters_dict().items()
                   if name.startswith(_MOMENTS)}
        if self.mesh.world_rank != 0:
            return out / name
        state = [{"name": "global_step", "data": self.optimizer.global_step}]
        state += [{"name": name, "data": Tensor(value)} for name, value in moments.items()]
        record = {"step": self.step, "args": vars(self.args), "replay": replay}

        def write(directory: Path) -> None:
            save_hf_checkpoint(weights, config, directory)
            ms.save_checkpoint(state, str(directory / "optimizer.ckpt"))
            (directory / TRAINER_STATE).write_text(json.dumps(record, indent=2))
            for file in TOKENIZER_FILES if checkpoint else ():
                if (Path(checkpoint) / file).exists():
                    shutil.copy(Path(checkpoint) / file, directory / file)

        return run_directory.save(out, name, write)

    def restore(self, directory: Path) -> None:
        """Weights and optimizer state from a checkpoint written under any split (each rank its part);
        a moment or ``global_step`` missing from optimizer.ckpt is an error naming them (MindSpore
        itself only warns, and the optimizer would restart them from zero)."""
        load_weights(self.lm, directory, "hf", progress=False)
        state = {name: value for name, value in ms.load_checkpoint(str(directory / "optimizer.ckpt")).items()
                 if name == "global_step" or name.startswith(_MOMENTS)}
        tp = self.lm.tensor_parallel
        if tp is not None:
            for name, value in state.items():
                index = tp.index(name.split(".", 1)[1], self.lm.config) if name.startswith(_MOMENTS) else None
                if index is not None:
                    state[name] = ms.Parameter(Tensor(value.asnumpy()[index]), name=name)
        # The learning rate is not in the file: the schedule follows this run's --steps; global_step carries on.
        not_loaded, unused = ms.load_param_into_net(self.optimizer, state, strict_load=True)
        missing = [name for name in not_loaded if name == "global_step" or name.startswith(_MOMENTS)]
        if missing or unused:
            problem = f"lacks {', '.join(missing)}" if missing else f"has {', '.join(unused)}, not in this model"
            raise CheckpointError(f"{directory / 'optimizer.ckpt'}: {problem}")
        self.step = self.saved_step = trainer_state(directory)["step"]


def trainer_state(directory: Path) -> dict:
    """A checkpoint's trainer.json; a clear error naming the file when it is missing or unreadable."""
    path = directory / TRAINER_STATE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {directory} is not a checkpoint of models.llama.train") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable ({exc})") from None


def replay_state(args) -> dict:
    """What decides the batches of every step: ``REPLAY_ARGS`` and the sha256 of the data file."""
    digest = run_directory.sha256_file(args.data)  # chunked: hashlib.file_digest needs Python 3.11
    return {"data_sha256": digest, **{name: getattr(args, name) for name in REPLAY_ARGS}}


def resume_problems(saved: dict, args, replay: dict) -> list[str]:
    """Why the run saved as ``saved`` (a trainer.json) cannot go on as ``args`` asks: the replay
    values that changed, or a run already finished."""
    before = saved.get("replay", {})
    problems = []
    if before.get("data_sha256") != replay["data_sha256"]:
        problems.append(f"--data {args.data} is not the file the run trained on (its sha256 differs)")
    problems += [f"--{name.replace('_', '-')} {replay[name]} differs from the run's {before.get(name)}"
                 for name in REPLAY_ARGS if before.get(name) != replay[name]]
    if not problems and saved["step"] >= args.steps:
        problems.append(f"the run is finished (step {saved['step']} of --steps {args.steps}); raise --steps to go on")
    return problems


class StopRequest:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal, a dropped ssh) ask the run to stop: a handler
    sets a flag, read at the next step boundary,
    so a signal never cuts a step in half (weights, optimizer state and step counter stay one
    state); a second signal aborts at once (KeyboardInterrupt; the checkpoints stay whole). Under
    msrun the ranks agree through a one-element all-reduce over the world at every boundary, so all
    stop after the same step, even when the signal reached only some of them. (Both signals are
    handled alike: once a graph has run, MindSpore's own SIGINT handler re-raises SIGINT as SIGTERM.)
    A signal the caller ignores stays ignored: ``nohup`` keeps a run going when its terminal closes."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, distributed: bool):
        from ms_rope_attention.distributed import GroupCollective

        self.world = GroupCollective() if distributed else None
        self.received = False
        self.previous = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # where Python runs signal handlers
            self.previous = {number: signal.signal(number, self._handle) for number in self.SIGNALS
                             if signal.getsignal(number) is not signal.SIG_IGN}
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)

    def _handle(self, number, frame) -> None:
        if self.received:
            raise KeyboardInterrupt
        self.received = True

    def _sum(self, value: float) -> float:
        return float(self.world.all_reduce(Tensor(np.float32(value))).asnumpy())

    def agreed(self) -> bool:
        """Whether any rank received a signal (every rank calls this at the same step)."""
        return self.received if self.world is None else self._sum(self.received) > 0

    def barrier(self) -> None:
        """Every rank waits here until all arrive (rank 0 has written what it saved before)."""
        if self.world is not None:
            self._sum(0.0)


def build_model(config: LlamaConfig, args, mesh) -> LlamaForCausalLM:
    """The model to train: the checkpoint's weights, or a random initialisation that is the same
    whatever the split (a tensor-parallel rank takes its slices of one process's; for a large model
    start from a checkpoint, as this holds the whole model once per rank while it starts)."""
    kwargs = dict(layout="TND" if args.packing == "varlen" else "BSH", backend=args.backend,
                  max_positions=max(args.seq_len, config.max_position_embeddings))
    tensor_parallel = mesh is not None and mesh.tensor.size > 1
    if args.checkpoint or not tensor_parallel:
        lm = LlamaForCausalLM(config, **kwargs, parallel=mesh)
        if args.checkpoint:
            load_weights(lm, args.checkpoint, read_config(args.checkpoint)[1], progress=False)
        return lm
    from mindspore.nn.utils import no_init_parameters

    whole = model_state(LlamaForCausalLM(config, **kwargs))
    with no_init_parameters():
        lm = LlamaForCausalLM(config, **kwargs, parallel=mesh)
    scatter_state(lm, whole)
    return lm


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m models.llama.train")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="Hugging Face or Meta checkpoint directory to fine-tune")
    source.add_argument("--model", help="a preset with random weights (tiny, 7b, ...)")
    parser.add_argument("--data", required=True, help=".txt (a document per line) or .jsonl ({\"text\": ...})")
    parser.add_argument("--out", default="runs/llama", help="checkpoint directory (a new run needs it empty)")
    reuse = parser.add_mutually_exclusive_group()
    reuse.add_argument("--resume", action="store_true", help="continue from OUT/latest")
    reuse.add_argument("--overwrite", action="store_true", help="delete OUT's checkpoints and start a new run")
    parser.add_argument("--steps", type=positive_int, default=200, help="optimizer steps in all")
    parser.add_argument("--seq-len", type=positive_int, default=128)
    parser.add_argument("--batch-size", type=positive_int, default=4,
                        help="rows (fixed) or row-equivalents of tokens (varlen)")
    parser.add_argument("--packing", default="fixed", choices=["fixed", "varlen"])
    parser.add_argument("--accumulate", type=positive_int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--clip", type=float, default=1.0, help="global gradient norm (0 = off)")
    parser.add_argument("--save-every", type=positive_int, default=100, help="steps between checkpoints")
    parser.add_argument("--amp", default="O0", choices=["O0", "O1", "O2", "O3"], help="mixed precision level")
    parser.add_argument("--backend", default="auto", choices=["auto", "fused", "unfused"])
    parser.add_argument("--layers", type=positive_int, help="with --model: number of layers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", default="graph", choices=["graph", "pynative"])
    parser.add_argument("--device", default="CPU")
    parser.add_argument("--data-parallel", action="store_true",
                        help="under msrun: each rank trains on its share of every batch (see docs/distributed.md)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                        help="under msrun: split heads, MLP and vocabulary over T ranks")
    parser.add_argument("--context-parallel", type=int, default=1, metavar="C",
                        help="under msrun: split every sequence over C ranks (--packing fixed)")
    args = parser.parse_args(argv)
    if args.checkpoint:  # recorded for --resume: the same checkpoint from any working directory
        args.checkpoint = os.path.abspath(args.checkpoint)
    ms.set_device(args.device)
    mesh = None
    if args.data_parallel or args.tensor_parallel > 1 or args.context_parallel > 1:
        from mindspore.communication import init

        from ms_rope_attention.distributed import ParallelMesh

        init()  # first: msrun's scheduler runs the script up to init()
        mesh = ParallelMesh.create(tensor=args.tensor_parallel, context=args.context_parallel)
    ms.set_context(mode=ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE)
    ms.set_seed(args.seed)

    config = read_config(args.checkpoint)[0] if args.checkpoint else preset(args.model)
    if args.layers and not args.checkpoint:
        config = config.replace(num_hidden_layers=args.layers)
    tokenizer = make_tokenizer(config, args.checkpoint)
    eos = None if isinstance(tokenizer, ByteTokenizer) else config.eos_token_ids[0]
    docs = read_documents(args.data, tokenizer, args.seq_len, eos, config.vocab_size)
    out, replay = Path(args.out), replay_state(args)
    try:
        resume_from = run_directory.prepare(out, resume=args.resume, overwrite=args.overwrite,
                                            writer=mesh is None or mesh.world_rank == 0)
        problems = resume_problems(trainer_state(resume_from), args, replay) if resume_from else []
    except (run_directory.RunDirectoryError, CheckpointError) as exc:
        parser.error(str(exc))
    if problems:
        parser.error(f"--resume from {resume_from}: " + "; ".join(problems))
    lm = build_model(config, args, mesh)
    trainer = Trainer(lm, args)
    if resume_from:
        trainer.restore(resume_from)
    stream = batches(docs, args.packing, args.batch_size, args.seq_len, args.seed)
    for _ in range(trainer.step * args.accumulate):  # the batches the finished steps consumed
        next(stream)

    from tqdm import tqdm

    bar = tqdm(total=args.steps, initial=trainer.step, desc=f"train ({lm.backend})", unit="step")
    with StopRequest(distributed=mesh is not None) as stop:
        while trainer.step < args.steps:
            micro = [next(stream) for _ in range(args.accumulate)]
            tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels, _ in micro)
            start = time.perf_counter()
            loss = trainer.train_step(micro)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
            bar.update(1)
            if trainer.step % args.save_every == 0 or trainer.step == args.steps:
                saved = trainer.save(out, config, args.checkpoint, replay)
            if trainer.step < args.steps and stop.agreed():
                saved = trainer.save(out, config, args.checkpoint, replay)
                stop.barrier()
                bar.close()
                by = "a signal" if stop.received else "another rank's signal"
                raise SystemExit(f"interrupted by {by}: step {trainer.step} saved to {saved}; continue with --resume")
        stop.barrier()  # no rank ends before rank 0 has written the last checkpoint
    bar.close()
    print(f"final loss {loss:.4f}; checkpoint {saved}")


if __name__ == "__main__":
    main()
