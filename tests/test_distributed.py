"""ms_rope_attention.distributed: the load-balanced layout and the ring's per-block numerics against
the one-call op on one process; then, under msrun on 2 ranks (one launch for every check,
tests/distributed/parallel_checks.py), the context-parallel attention and a tensor-parallel
attention block, each rank against the one-process computation, with their negative controls."""
import time
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from safetensors.numpy import load_file

from ms_rope_attention import rope_tables, rotary_flash_attention
from ms_rope_attention.distributed import load_balanced_chunks, load_balanced_merge, merge_by_lse, ring_attention_blocks
from ms_rope_attention.distributed.launch import launch
from ms_rope_attention.distributed.mesh import mesh_ranks
from models.llama import generate as generate_cli
from models.llama import train as train_cli

CHECKS = Path(__file__).resolve().parent / "distributed" / "parallel_checks.py"
LAUNCH_CHECKS = ["cp-graph-gqa-fp32", "cp-pynative-gqa-fp32", "cp-graph-partial-interleaved", "cp-pynative-mha-partial",
                 "cp-graph-fp16", "cp-graph-mqa-batch1-long", "tp-graph-attention-block", "tp-pynative-attention-block",
                 "tp-plain-allreduce-gives-wrong-gradients", "cp-llama-training-step-graph",
                 "cp-llama-training-step-pynative", "tp-llama-graph", "tp-llama-pynative",
                 "tp-llama-replicated-kv-graph", "native-gather-gradient-refused"]


def test_load_balanced_layout_round_trips(rng):
    x = rng.standard_normal((2, 24, 3))
    parts = [load_balanced_chunks(x, r, 3) for r in range(3)]
    assert [p.shape for p in parts] == [(2, 8, 3)] * 3
    np.testing.assert_array_equal(parts[1], np.concatenate([x[:, 4:8], x[:, 16:20]], 1))  # chunks 1 and 4 of 6
    np.testing.assert_array_equal(load_balanced_merge(parts), x)
    with pytest.raises(ValueError, match="multiple of 2 x context-parallel size = 6"):
        load_balanced_chunks(x[:, :20], 0, 3)


def test_merge_by_lse_of_rows_without_keys():
    out = ms.Tensor(np.ones((1, 2, 1, 4), np.float32))
    lse = ms.Tensor(np.array([[[-np.inf, 0.0]]], np.float32))
    merged, merged_lse = merge_by_lse(out * 0, lse, out * 0, lse)
    assert np.all(merged.asnumpy() == 0) and merged_lse.asnumpy()[0, 0, 0] == -np.inf
    merged, merged_lse = merge_by_lse(out, lse, out * 3, ms.Tensor(np.array([[[-np.inf, 0.0]]], np.float32)))
    np.testing.assert_allclose(merged.asnumpy()[0, 1, 0], 2.0, rtol=1e-6)  # equal mass: the mean
    np.testing.assert_allclose(merged_lse.asnumpy()[0, 0, 1], np.log(2.0), rtol=1e-6)


@pytest.mark.parametrize("heads,kv_heads,rotary_dim,rotary_mode", [(4, 2, None, 0), (4, 1, 16, 1)])
def test_ring_blocks_equal_the_one_call_op(heads, kv_heads, rotary_dim, rotary_mode, mode, rng):
    """4 blocks as 4 ring ranks would compute them (keys rotated once, in their block's causal call,
    then reused rotated), merged by lse: output, lse and dq/dk/dv equal one call on the sequence,
    eagerly and as a graph."""
    length, dim = 64, 32
    q = ms.Tensor(rng.standard_normal((2, length, heads, dim)).astype(np.float32))
    k, v = (ms.Tensor(rng.standard_normal((2, length, kv_heads, dim)).astype(np.float32)) for _ in range(2))
    cos, sin = map(ms.Tensor, rope_tables(rotary_dim or dim, length, rotary_mode=rotary_mode))
    d_out = ms.Tensor(rng.standard_normal(q.shape).astype(np.float32))
    d_lse = ms.Tensor(rng.standard_normal((2, heads, length)).astype(np.float32))

    class OneCall(ms.nn.Cell):
        def construct(self, q, k, v):
            return rotary_flash_attention(q, k, v, cos, sin, input_layout="BSND", return_softmax_lse=True,
                                          rotary_dim=rotary_dim, rotary_mode=rotary_mode)

    class Ring(ms.nn.Cell):
        def construct(self, q, k, v):
            return ring_attention_blocks(q, k, v, cos, sin, 4, rotary_dim=rotary_dim, rotary_mode=rotary_mode)

    class Loss(ms.nn.Cell):
        def __init__(self, attention):
            super().__init__()
            self.attention = attention

        def construct(self, q, k, v):
            out, lse = self.attention(q, k, v)
            return (out * d_out).sum() + (lse * d_lse).sum(), out, lse

    results = []
    for attention in (OneCall(), Ring()):
        grads, (out, lse) = ms.grad(Loss(attention), grad_position=(0, 1, 2), has_aux=True)(q, k, v)
        results.append([x.asnumpy() for x in (out, lse, *grads)])
    for name, want, got in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), name


def test_mesh_ranks_lay_the_tensor_axis_fastest():
    """8 ranks as data 2 x context 2 x tensor 2: rank 5 = (d 1, c 0, t 1)."""
    assert mesh_ranks(5, 8, tensor=2, context=2) == {"data": (1, 5), "context": (5, 7), "tensor": (4, 5),
                                                     "replicas": (1, 3, 5, 7)}
    assert mesh_ranks(2, 4, tensor=2) == {"data": (0, 2), "context": (2,), "tensor": (2, 3), "replicas": (0, 2)}
    with pytest.raises(ValueError, match="tensor x context = 4 x 1: expected a divisor of the world size 6"):
        mesh_ranks(0, 6, tensor=4)
    with pytest.raises(ValueError, match="data x context x tensor = 3 x 1 x 2 = 6: expected the world size 8"):
        mesh_ranks(0, 8, tensor=2, data=3)
    with pytest.raises(ValueError, match="context: expected a positive int, got 0"):
        mesh_ranks(0, 2, context=0)


# The tests of the one launch run in one worker (the group), so that the launch runs once: a module
# fixture runs once per xdist worker, and each run of it is a 2-rank job of about 100-150 s.
def one_launch(test):
    return pytest.mark.integration(pytest.mark.starts_first(pytest.mark.xdist_group("distributed-launch")(test)))


@pytest.fixture(scope="module")
def launched():
    return launch(CHECKS, ["--negative"], workers=2, timeout=600)


def _lines(launched, prefix):
    """Each rank's RESULT lines whose check starts with ``prefix``, after every check was seen to run."""
    results = launched.results()
    for rank, lines in enumerate(results):
        names = [line.split()[1] for line in lines]
        assert names == LAUNCH_CHECKS, f"rank {rank} ran {names}\n{launched.logs[rank][-3000:]}"
    return [[line for line in lines if line.split()[1].startswith(prefix)] for lines in results]


def _assert_ok(rank_lines):
    for rank, lines in enumerate(rank_lines):
        failed = [line for line in lines if line.split()[2] != "OK"]
        assert not failed, f"rank {rank}: {failed}"


@one_launch
def test_context_parallel_attention_equals_one_process(launched):
    """CP=2, load-balanced: every rank's output, lse, dq, dk and dv within 1e-5 of the one-process
    op (2e-3 in float16), GRAPH_MODE and PyNative, GQA/MHA/MQA, partial and interleaved rotary."""
    _assert_ok([[line for line in lines if not line.split()[1].startswith("cp-llama-")]
                for lines in _lines(launched, "cp-")])


@one_launch
def test_llama_context_parallel_training_step_equals_one_process(launched):
    """The tiny Llama with CP=2: the ranks' losses and weight gradients summed equal one process's
    mean cross-entropy and gradients on the whole batch (1e-5), both modes."""
    _assert_ok(_lines(launched, "cp-llama-"))


@one_launch
def test_tensor_parallel_block_equals_one_process(launched):
    """TP=2: dx and each rank's weight-shard gradients within 1e-5 of one process, both modes; g as a
    plain AllReduce is off by more than 1e-2 (the control)."""
    _assert_ok([[line for line in lines if not line.split()[1].startswith("tp-llama-")]
                for lines in _lines(launched, "tp-")])


@one_launch
def test_tensor_parallel_llama_equals_one_process(launched):
    """TP=2 tiny Llama loaded slice by slice from a one-process checkpoint: logits within 1e-5 and
    the same greedy tokens with the KV cache (KV heads split, and replicated; the paged engine too, whole
    prompts and chunked, in GRAPH_MODE), the same loss and each
    rank's gradients equal to the slices of one process's (both modes), and the gathered weights
    equal the checkpoint's and load back into one process."""
    _assert_ok(_lines(launched, "tp-llama-"))


@one_launch
def test_native_allgather_gradient_is_refused_on_cpu(launched):
    """MindSpore's own AllGather gradient is ReduceScatter, which the CPU lacks: the summed gradient
    of GatherChunks is what makes context parallelism trainable here."""
    _assert_ok(_lines(launched, "native-"))


def _assert_same_weights(one, other, steps):
    """The checkpoints of two runs after each of ``steps`` within 1e-4 of each tensor's largest value."""
    for step in steps:
        want = load_file(one / f"step-{step}" / "model.safetensors")
        got = load_file(other / f"step-{step}" / "model.safetensors")
        assert want.keys() == got.keys()
        worst = max(np.abs(want[k] - got[k]).max() / max(1e-6, np.abs(want[k]).max()) for k in want)
        assert worst <= 1e-4, (step, worst)


def _train(tmp_path, corpus, packing, name, steps, extra=(), workers=None):
    """``models.llama.train`` on the tiny preset (AdamW, constant learning rate, clipping at 1.0),
    in this process or launched on ``workers`` ranks; its checkpoint directory."""
    args = ["--model", "tiny", "--data", str(corpus), "--seq-len", "64", "--batch-size", "4", "--packing", packing,
            "--warmup", "0", "--min-lr-ratio", "1.0", "--save-every", "1", "--out", str(tmp_path / name),
            "--steps", str(steps), *extra]
    if workers is None:
        train_cli.main(args)
    else:
        run = launch(None, args, module="models.llama.train", workers=workers, timeout=900)
        assert run.returncode == 0, "\n".join(log[-3000:] for log in run.logs)
    return tmp_path / name


@pytest.mark.integration
@pytest.mark.starts_first
def test_data_parallel_packed_training_tracks_one_process_and_resumes(corpus, tmp_path):
    """``models.llama.train --data-parallel --packing varlen`` on 2 ranks (each rank whole documents
    of every packed batch): 3 steps, stopped, then resumed to 5 from rank 0's checkpoint; the weights
    after step 3 and step 5 equal one process's on the whole batches. (Fixed packing runs data
    parallel in the 4-rank test below.)"""
    one = _train(tmp_path, corpus, "varlen", "one", 5)
    _train(tmp_path, corpus, "varlen", "dp", 3, ["--data-parallel"], workers=2)
    dp = _train(tmp_path, corpus, "varlen", "dp", 5, ["--data-parallel", "--resume"], workers=2)
    _assert_same_weights(one, dp, (3, 5))
    assert not (dp / "step-6").exists() and (dp / "latest").read_text() == "step-5"


@pytest.mark.integration
@pytest.mark.starts_first
def test_data_parallel_composes_with_tensor_and_context_parallel(corpus, tmp_path):
    """4 ranks: 2 steps as data 2 x tensor 2, resumed to 4 as data 2 x context 2, then to 5 as
    context 2 x tensor 2, each from the whole weights and AdamW moments rank 0 gathered and wrote;
    the weights after steps 2, 4 and 5 equal one process's (the clipping norm taken over the whole
    tensor-parallel model)."""
    one = _train(tmp_path, corpus, "fixed", "one", 5)
    _train(tmp_path, corpus, "fixed", "mesh", 2, ["--tensor-parallel", "2"], workers=4)
    _train(tmp_path, corpus, "fixed", "mesh", 4, ["--context-parallel", "2", "--resume"], workers=4)
    mesh = _train(tmp_path, corpus, "fixed", "mesh", 5, ["--context-parallel", "2", "--tensor-parallel", "2",
                                                         "--resume"], workers=4)
    _assert_same_weights(one, mesh, (2, 4, 5))
    assert (mesh / "latest").read_text() == "step-5"


@pytest.mark.integration
def test_tensor_parallel_generation_cli_prints_one_process_tokens(capsys, tmp_path):
    """``models.llama.generate --tensor-parallel 2`` under msrun on a one-process checkpoint: rank 0
    prints the tokens one process generates (greedy, KV cache), and rank 1 prints nothing."""
    from models.llama import LlamaForCausalLM, preset
    from models.llama.weights import model_state, save_hf_checkpoint

    ms.set_seed(1)
    save_hf_checkpoint(model_state(LlamaForCausalLM(preset("tiny"))), preset("tiny"), tmp_path)
    args = ["--checkpoint", str(tmp_path), "--ids", "1,15,27", "--ids", "5,9", "--max-new-tokens", "6"]
    generate_cli.main(args)
    want = [line for line in capsys.readouterr().out.splitlines() if line.startswith("prompt ids")]
    run = launch(None, args + ["--tensor-parallel", "2"], module="models.llama.generate", workers=2, timeout=600)
    assert run.returncode == 0, "\n".join(log[-3000:] for log in run.logs)
    printed = [[line for line in log.splitlines() if line.startswith("prompt ids")] for log in run.logs]
    assert len(want) == 2 and printed == [want, []], printed
