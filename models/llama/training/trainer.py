"""The optimisation: AdamW on a warm-up then cosine schedule, gradient accumulation and global-norm
clipping over every parallel split, and the checkpoint a run saves and resumes from (weights,
optimizer state, and the values that decide which batches each step consumes)."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from ..config import LlamaConfig
from ..losses import ContextParallelTraining, LlamaForTraining, context_parallel_batch
from ..model import LlamaForCausalLM
from ..weights import CheckpointError, gathered_state, load_weights, model_state, save_hf_checkpoint
from . import run_directory
from .data import data_parallel_share

_MOMENTS = ("adam_m.", "adam_v.")  # AdamWeightDecay's moment parameters: prefix + the weight's name
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
TRAINER_STATE = "trainer.json"
# The arguments that decide which batches the steps consume (with the data file's sha256): a resume
# replays the finished steps' batches to skip them, so they must not change.
REPLAY_ARGS = ("seq_len", "batch_size", "packing", "accumulate", "seed", "model", "checkpoint")


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
