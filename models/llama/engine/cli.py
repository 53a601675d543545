"""Generate text with either engine, from the command line (``python -m models.llama.generate``).

    python -m models.llama.generate --checkpoint DIR --prompt "The capital of France is"
    python -m models.llama.generate --model tiny --ids 1,15,27 --max-new-tokens 8
    python -m models.llama.generate --model tiny --ids 1,15,27 --ids 1,15,28 --paged   # paged.py
    python -m ms_rope_attention.distributed.launch --workers 2 -m models.llama.generate \\
        --checkpoint DIR --prompt "..." --tensor-parallel 2     # each rank holds half the model
"""
from __future__ import annotations

import argparse

import mindspore as ms

from ms_rope_attention import COMPUTE_DTYPES

from ..model import LlamaForCausalLM
from .common import CACHE_MEMORY_FRACTION, GIB
from .contiguous import Generator
from .paged import PagedGenerator


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m models.llama.generate")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="Hugging Face (config.json) or Meta (params.json) checkpoint directory")
    source.add_argument("--model", help="a preset with random weights (tiny, 7b, 13b, 70b)")
    parser.add_argument("--prompt", action="append", help="prompt text (repeat for a batch); needs a tokenizer")
    parser.add_argument("--ids", action="append", help="prompt as comma-separated token ids (repeatable)")
    parser.add_argument("--layers", type=int, help="with --model: number of layers")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="the activations' dtype")
    parser.add_argument("--weight-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="the projections' and embedding's: 'auto' keeps a half checkpoint's own precision "
                             "on the CPU (with --model and no checkpoint: --dtype's)")
    parser.add_argument("--compute-dtype", default="auto", choices=list(COMPUTE_DTYPES),
                        help="the CPU ops' arithmetic: 'auto' computes a bfloat16 checkpoint in bfloat16 where this "
                             "CPU has native instructions for it, in float32 otherwise (docs/compute-dtype.md)")
    parser.add_argument("--backend", default="auto", choices=["auto", "fused", "unfused"])
    parser.add_argument("--mode", default="graph", choices=["graph", "pynative"])
    parser.add_argument("--device", default="CPU")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                        help="under msrun on T ranks: each holds its share of the model (docs/distributed.md)")
    parser.add_argument("--cache-memory-limit", type=float, metavar="GIB",
                        help=f"largest KV cache to allocate (default: {CACHE_MEMORY_FRACTION * 100:.0f}%% of the "
                             "memory available); with --paged, the cache's budget")
    parser.add_argument("--paged", action="store_true",
                        help="a block-paged cache with prefix caching (models/llama/engine/paged.py, docs/serving.md)")
    parser.add_argument("--block-size", type=int, default=16, help="with --paged: positions per block")
    args = parser.parse_args(argv)
    if args.cache_memory_limit is not None and args.cache_memory_limit <= 0:
        parser.error(f"--cache-memory-limit: expected a positive number of GiB, got {args.cache_memory_limit}")
    ms.set_device(args.device)
    mesh = None
    if args.tensor_parallel > 1:
        from mindspore.communication import init

        from ms_rope_attention.distributed import ParallelMesh

        init()  # first: msrun's scheduler runs the script up to init()
        mesh = ParallelMesh.create(tensor=args.tensor_parallel, data=1)
    ms.set_context(mode=ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE)

    from ..config import preset
    from ..tokenizer import Tokenizer
    from ..weights import load_checkpoint, read_config

    config = read_config(args.checkpoint)[0] if args.checkpoint else preset(args.model)
    tokenizer = Tokenizer.from_directory(args.checkpoint, config.bos_token_id) if args.checkpoint else None
    if args.prompt:
        if tokenizer is None:
            parser.error("--prompt needs a checkpoint with tokenizer.json or tokenizer.model; use --ids")
        prompts = [tokenizer.encode(p) for p in args.prompt]
    elif args.ids:
        prompts = [[int(t) for t in ids.split(",")] for ids in args.ids]
    else:
        parser.error("give --prompt or --ids")
    kwargs = dict(dtype=args.dtype, backend=args.backend, parallel=mesh, compute_dtype=args.compute_dtype)
    if args.checkpoint:
        model = load_checkpoint(args.checkpoint, weight_dtype=args.weight_dtype, **kwargs)
    else:
        weight_dtype = None if args.weight_dtype == "auto" else args.weight_dtype
        model = LlamaForCausalLM(config.replace(num_hidden_layers=args.layers) if args.layers else config,
                                 weight_dtype=weight_dtype, **kwargs)
    limit = None if args.cache_memory_limit is None else max(1, int(args.cache_memory_limit * GIB))
    if args.paged:
        generator = PagedGenerator(model, max_cache_bytes=limit, block_size=args.block_size,
                                   max_batch=min(8, len(prompts)))
    else:
        generator = Generator(model, slots=min(8, len(prompts)), cache_memory_limit=limit)
    result = generator.generate(prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
    if mesh is not None and mesh.world_rank != 0:
        return  # every rank generated the same tokens; one prints them
    for prompt, tokens in zip(prompts, result.tokens):
        text = tokenizer.decode(tokens) if tokenizer else ""
        print(f"prompt ids {prompt} -> {tokens}" + (f"\n{text}" if text else ""))
    print(f"backend {model.backend}; compute {model.compute_dtype}; TTFT {result.ttft_s * 1e3:.1f} ms (compile {result.compile_s:.1f} s "
          f"excluded); decode {result.decode_tokens_per_s:.1f} tokens/s per sequence")
