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
the end, and on SIGINT / SIGTERM / SIGHUP: the ranks stop after the same step and save it) are Hugging Face
safetensors directories that ``models.llama.generate --checkpoint`` loads, plus the optimizer state
for ``--resume``; they are written so that a kill never breaks one (run_directory.py).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import mindspore as ms

from ..config import LlamaConfig, preset
from ..losses import IGNORE_INDEX
from ..model import LlamaForCausalLM
from ..weights import CheckpointError, load_weights, model_state, read_config, scatter_state
from . import run_directory
from .data import ByteTokenizer, batches, make_tokenizer, read_documents
from .signals import StopRequest
from .trainer import Trainer, replay_state, resume_problems, trainer_state


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


def _parser() -> argparse.ArgumentParser:
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
    return parser


def main(argv=None) -> None:
    parser = _parser()
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
