"""Run by tests/test_distributed.py under msrun (2 workers, one launch for every check): each rank
checks its part of a parallel computation against the one-process computation, done in the same
process, and prints one ``RESULT <check> OK|FAIL <detail>`` line per check.

- context parallel: the load-balanced attention's output, lse and dq/dk/dv;
- tensor parallel: a Megatron attention block around the op (column-parallel q/k/v, the op on the
  rank's heads, row-parallel o; f and g): loss, dx and every weight shard's gradient;
- a tiny Llama's training step with context parallelism: the ranks' losses and weight gradients
  summed equal one process's mean cross-entropy and gradients on the whole batch;
- a tensor-parallel tiny Llama loaded from a one-process checkpoint (each rank its slices): logits
  and greedy tokens (KV cache; in GRAPH_MODE the paged engine too, whole prompts and chunked) equal one
  process's, GQA split and KV heads replicated; one training
  step's gradients equal the slices of one process's; the gathered weights load back into one process;
- negative controls: g as a plain AllReduce (wrong gradients), and, last, MindSpore's own AllGather
  gradient (ReduceScatter, which CPUs lack; after a failed collective, later ones can block)."""
import sys
import traceback

import mindspore as ms
import numpy as np
from mindspore.communication import init

ms.set_device("CPU")
init()  # before anything else: msrun's scheduler runs this script up to here

from ms_rope_attention import rope_tables, rotary_flash_attention  # noqa: E402
from ms_rope_attention.distributed import (ContextParallelRotaryAttention, CopyToTensorParallel,  # noqa: E402
                                           ParallelMesh, ReduceFromTensorParallel, group_geometry,
                                           load_balanced_chunks)

RANK, SIZE = group_geometry()
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


class Loss(ms.nn.Cell):
    """sum(out * d_out) + sum(lse * d_lse): its gradients are the op's backward for (d_out, d_lse)."""

    def __init__(self, attention):
        super().__init__()
        self.attention = attention

    def construct(self, q, k, v, cos, sin, d_out, d_lse):
        out, lse = self.attention(q, k, v, cos, sin)
        return (out.astype(ms.float32) * d_out).sum() + (lse * d_lse).sum(), out, lse


class Whole(ms.nn.Cell):
    """The op on the whole sequence, one process (the reference)."""

    def __init__(self, **attrs):
        super().__init__()
        self.attrs = attrs

    def construct(self, q, k, v, cos, sin):
        return rotary_flash_attention(q, k, v, cos, sin, input_layout="BSND", return_softmax_lse=True, **self.attrs)


def run(net, *args):
    """(out, lse, [dq, dk, dv]) of ``net``'s loss (its other outputs are auxiliary)."""
    grads, (out, lse) = ms.grad(net, grad_position=(0, 1, 2), has_aux=True)(*args)
    return out.asnumpy().astype(np.float64), lse.asnumpy(), [g.asnumpy().astype(np.float64) for g in grads]


def report(name, errors, tolerance):
    worst = max(errors.values())
    detail = " ".join(f"{k}={e:.2e}" for k, e in errors.items())
    print(f"RESULT {name} {'OK' if worst <= tolerance else 'FAIL'} {detail}", flush=True)


def relative(got, want):
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


def check_context_parallel(name, mode, dtype="float32", heads=4, kv_heads=2, head_dim=32, rotary_dim=None, rotary_mode=0, batch=2,
          length=64):
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    rng = np.random.default_rng(7)  # the same on every rank
    q = rng.standard_normal((batch, length, heads, head_dim)).astype(dtype)
    k, v = (rng.standard_normal((batch, length, kv_heads, head_dim)).astype(dtype) for _ in range(2))
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    d_lse = rng.standard_normal((batch, heads, length)).astype(np.float32)
    cos, sin = rope_tables(rotary_dim or head_dim, length, rotary_mode=rotary_mode)
    attrs = dict(rotary_mode=rotary_mode, rotary_dim=rotary_dim)
    T = lambda x: ms.Tensor(x)  # noqa: E731
    ref_out, ref_lse, ref_grads = run(Loss(Whole(**attrs)), *map(T, (q, k, v, cos, sin, d_out, d_lse)))
    part = lambda x, axis=1: load_balanced_chunks(x, RANK, SIZE, axis)  # noqa: E731
    cp = ContextParallelRotaryAttention(with_softmax_lse=True, **attrs)
    out, lse, grads = run(Loss(cp), *map(T, (part(q), part(k), part(v), cos, sin, part(d_out), part(d_lse, 2))))
    errors = {"out": np.abs(out - part(ref_out)).max(), "lse": np.abs(lse - part(ref_lse, 2)).max()}
    for label, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        errors[label] = relative(got, part(want))
    report(name, errors, TOLERANCE[dtype])


class AttentionBlock(ms.nn.Cell):
    """o(attention(q(x), k(x), v(x))) with weights (out, in) as inputs; with ``tp`` the rank's
    shards between Megatron's f and g (or, as the negative control, a plain AllReduce for g)."""

    def __init__(self, heads, tp=False, plain_allreduce=False):
        super().__init__()
        self.heads, self.tp = heads, tp
        self.f = CopyToTensorParallel()
        self.g = ms.ops.AllReduce() if plain_allreduce else ReduceFromTensorParallel()

    def construct(self, x, wq, wk, wv, wo, cos, sin, d_y):
        if self.tp:
            x = self.f(x)
        mm = lambda a, w: ms.ops.matmul(a, w.T)  # noqa: E731
        out = rotary_flash_attention(mm(x, wq), mm(x, wk), mm(x, wv), cos, sin, self.heads, input_layout="BSH")
        y = mm(out, wo)
        if self.tp:
            y = self.g(y)
        return (y * d_y).sum()


def check_tensor_parallel(name, mode, plain_allreduce=False):
    """TP=2 over heads: 4 query heads and 2 KV heads, 2 and 1 per rank."""
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    rng = np.random.default_rng(11)
    hidden, heads, kv_heads, dim, batch, length = 32, 4, 2, 8, 2, 16
    x = rng.standard_normal((batch, length, hidden)).astype(np.float32)
    wq = rng.standard_normal((heads * dim, hidden)).astype(np.float32) / 4
    wk, wv = (rng.standard_normal((kv_heads * dim, hidden)).astype(np.float32) / 4 for _ in range(2))
    wo = rng.standard_normal((hidden, heads * dim)).astype(np.float32) / 4
    d_y = rng.standard_normal((batch, length, hidden)).astype(np.float32)
    cos, sin = rope_tables(dim, length)
    T = lambda a: ms.Tensor(np.ascontiguousarray(a))  # noqa: E731
    positions = tuple(range(5))
    want = ms.grad(AttentionBlock(heads), grad_position=positions)(*map(T, (x, wq, wk, wv, wo, cos, sin, d_y)))
    rows = lambda w: np.split(w, SIZE, 0)[RANK]  # noqa: E731 (column parallel: the rank's output features)
    shards = (x, rows(wq), rows(wk), rows(wv), np.split(wo, SIZE, 1)[RANK])
    got = ms.grad(AttentionBlock(heads // SIZE, tp=True, plain_allreduce=plain_allreduce),
                  grad_position=positions)(*map(T, (*shards, cos, sin, d_y)))
    want = [w.asnumpy() for w in want]
    want_shards = (want[0], rows(want[1]), rows(want[2]), rows(want[3]), np.split(want[4], SIZE, 1)[RANK])
    errors = {label: relative(g.asnumpy(), w) for label, g, w in zip(("dx", "dwq", "dwk", "dwv", "dwo"), got,
                                                                      want_shards)}
    if plain_allreduce:  # the control passes when the gradients are wrong
        print(f"RESULT {name} {'OK' if max(errors.values()) > 1e-2 else 'FAIL'} "
              + " ".join(f"{k}={e:.2e}" for k, e in errors.items()), flush=True)
    else:
        report(name, errors, 1e-5)


def check_llama_context_parallel(name, mode):
    """CP=2 training step of the tiny Llama (2 layers, GQA 4/2), batch 2 x 32 tokens."""
    from models.llama import LlamaForCausalLM, preset
    from models.llama.losses import ContextParallelTraining, LlamaForTraining, context_parallel_batch

    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    ms.set_seed(5)  # the same weights on every rank
    config = preset("tiny")
    whole = LlamaForCausalLM(config)
    parted = LlamaForCausalLM(config, parallel=ParallelMesh.create(context=SIZE))
    ms.load_param_into_net(parted, whole.parameters_dict(), strict_load=True)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, config.vocab_size, (2, 32)).astype(np.int32)
    labels = ids.copy()
    labels[0, :5] = -100  # a few tokens take no part
    reference = LlamaForTraining(whole)
    want_loss, want_grads = ms.value_and_grad(reference, None, reference.trainable_params())(
        ms.Tensor(ids), ms.Tensor(labels))
    part_ids, part_targets, scored = context_parallel_batch(ids, labels, RANK, SIZE)
    net = ContextParallelTraining(parted)
    loss, grads = ms.value_and_grad(net, None, net.trainable_params())(
        ms.Tensor(part_ids), ms.Tensor(part_targets), ms.Tensor(scored, ms.int32))
    reduce = ms.ops.AllReduce()
    errors = {"loss": abs(float(reduce(loss).asnumpy()) - float(want_loss.asnumpy()))}
    errors["grads"] = max(relative(reduce(g).asnumpy(), w.asnumpy()) for g, w in zip(grads, want_grads))
    report(name, errors, 1e-5)


def check_llama_tensor_parallel(name, mode, kv_heads=2):
    """TP=2 tiny Llama (4 heads; 2 KV heads split, or 1 replicated) from a one-process checkpoint."""
    import tempfile

    from mindspore.nn.utils import no_init_parameters

    from models.llama import LlamaForCausalLM, preset
    from models.llama.engine import Generator
    from models.llama.losses import LlamaForTraining
    from models.llama.weights import gathered_state, load_checkpoint, load_weights, model_state, save_hf_checkpoint

    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    ms.set_seed(9)  # the same one-process weights on every rank
    config = preset("tiny", num_key_value_heads=kv_heads)
    whole = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as scratch:
        save_hf_checkpoint(model_state(whole), config, scratch)
        with no_init_parameters():
            tp = LlamaForCausalLM(config, parallel=ParallelMesh.create(tensor=SIZE))
        load_weights(tp, scratch, progress=False)
    rng = np.random.default_rng(4)
    ids = ms.Tensor(rng.integers(0, config.vocab_size, (2, 24)).astype(np.int32))
    want = whole(ids).asnumpy()
    errors = {"logits": relative(tp(ids).asnumpy(), want)}
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (7, 13)]
    want_tokens = Generator(whole, slots=2).generate(prompts, 6, eos_ids=()).tokens
    errors["tokens differ"] = 0.0 if Generator(tp, slots=2).generate(prompts, 6, eos_ids=()).tokens == want_tokens else 1.0
    if mode == "graph":  # the paged engine on each rank's KV heads: whole prompts (20 tokens: the prefill graph),
        from models.llama.engine import PagedGenerator  # and 8 tokens a step (chunks in place, the decode graph)

        for budget in (None, 8):
            paged = PagedGenerator(tp, max_batch=2, max_cache_bytes=1 << 20, max_num_batched_tokens=budget)
            same = paged.generate(prompts, 6, eos_ids=()).tokens == want_tokens
            errors[f"paged tokens differ (budget {budget})"] = 0.0 if same else 1.0
    labels = ids
    nets = LlamaForTraining(whole), LlamaForTraining(tp)
    (want_loss, want_grads), (loss, grads) = (ms.value_and_grad(n, None, n.trainable_params())(ids, labels)
                                              for n in nets)
    errors["loss"] = abs(float(loss.asnumpy()) - float(want_loss.asnumpy()))
    full = dict(zip((p.name for p in nets[0].trainable_params()), want_grads))
    worst = 0.0
    for param, grad in zip(nets[1].trainable_params(), grads):
        index = tp.tensor_parallel.index(param.name, config)
        expected = full[param.name].asnumpy()
        worst = max(worst, relative(grad.asnumpy(), expected if index is None else expected[index]))
    errors["grads"] = worst
    back = gathered_state(tp)
    errors["gathered weights"] = max(float(np.abs(back[k] - v).max()) for k, v in model_state(whole).items())
    with tempfile.TemporaryDirectory() as scratch:
        save_hf_checkpoint(back, config, scratch)
        errors["reloaded logits"] = relative(load_checkpoint(scratch, progress=False)(ids).asnumpy(), want)
    report(name, errors, 1e-5)


def negative_control():
    """MindSpore's own AllGather gradient (ReduceScatter) on a CPU: refused, which is why the
    gather's gradient is written here."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    rng = np.random.default_rng(7)
    q = ms.Tensor(load_balanced_chunks(rng.standard_normal((1, 32, 2, 16)).astype(np.float32), RANK, SIZE))
    cos, sin = map(ms.Tensor, rope_tables(16, 32))
    cp = ContextParallelRotaryAttention(native_backward=True)
    try:
        ms.grad(lambda q: cp(q, q, q, cos, sin).sum())(q).asnumpy()
        print("RESULT native-gather-gradient-refused FAIL the native gradient ran on a CPU", flush=True)
    except Exception as exc:  # noqa: BLE001 (the control expects MindSpore's own error)
        said = [line.strip() for line in str(exc).splitlines() if "ReduceScatter" in line]
        print(f"RESULT native-gather-gradient-refused {'OK' if said else 'FAIL'} "
              f"{(said or [repr(exc)])[0][:200]}", flush=True)


CHECKS = [
    ("cp-graph-gqa-fp32", check_context_parallel, ("graph",), {}),
    ("cp-pynative-gqa-fp32", check_context_parallel, ("pynative",), {}),
    ("cp-graph-partial-interleaved", check_context_parallel, ("graph",), dict(rotary_dim=16, rotary_mode=1)),
    ("cp-pynative-mha-partial", check_context_parallel, ("pynative",), dict(kv_heads=4, rotary_dim=16)),
    ("cp-graph-fp16", check_context_parallel, ("graph",), dict(dtype="float16")),
    ("cp-graph-mqa-batch1-long", check_context_parallel, ("graph",), dict(kv_heads=1, batch=1, length=256)),
    ("tp-graph-attention-block", check_tensor_parallel, ("graph",), {}),
    ("tp-pynative-attention-block", check_tensor_parallel, ("pynative",), {}),
    ("tp-plain-allreduce-gives-wrong-gradients", check_tensor_parallel, ("graph",), dict(plain_allreduce=True)),
    ("cp-llama-training-step-graph", check_llama_context_parallel, ("graph",), {}),
    ("cp-llama-training-step-pynative", check_llama_context_parallel, ("pynative",), {}),
    ("tp-llama-graph", check_llama_tensor_parallel, ("graph",), {}),
    ("tp-llama-pynative", check_llama_tensor_parallel, ("pynative",), {}),
    ("tp-llama-replicated-kv-graph", check_llama_tensor_parallel, ("graph",), dict(kv_heads=1)),
]

if __name__ == "__main__":
    for name, fn, args, kwargs in CHECKS:
        try:
            fn(name, *args, **kwargs)
        except Exception:  # noqa: BLE001 (reported, and the test fails on it)
            print(f"RESULT {name} FAIL {traceback.format_exc()[-600:]!r}", flush=True)
    if "--negative" in sys.argv:
        negative_control()
