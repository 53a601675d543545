"""An OpenAI-compatible HTTP server for a Llama checkpoint (docs/serving.md#the-http-server).

    python -m models.llama.serve --checkpoint DIR [--port 8000] [--api-key KEY]
    python -m models.llama.serve --model tiny      # random weights and a word-level tokenizer, to try it
    python -m ms_rope_attention.distributed.launch --workers 2 -m models.llama.serve --checkpoint DIR \
        --tensor-parallel 2 --cache-gib 4              # each rank holds half the model; rank 0 serves HTTP

The model runs in GRAPH_MODE on the fused op, on ``PagedGenerator`` (block-paged KV cache, prefix
caching on unless ``--no-prefix-caching``). The server binds 127.0.0.1 unless ``--host`` says
otherwise; set the API key with ``RFA_API_KEY`` rather than ``--api-key`` (a command line is visible
to every user of the machine). The checkpoint is loaded before the port opens; the warm-up (graph
compilation) runs after, with ``/ready`` answering 503 until it ends. With ``--tensor-parallel T`` under the
launcher, rank 0 serves HTTP and schedules and every rank runs its share of each step (``lockstep``).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import tempfile
from pathlib import Path

import ms_rope_attention  # noqa: F401  before MindSpore: its threads' setting (docs/threads.md)
import mindspore as ms

from ..engine import PagedGenerator
from ..engine.common import GIB


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.llama.serve", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="Hugging Face (config.json) or Meta (params.json) checkpoint directory "
                                             "with tokenizer.json or tokenizer.model")
    source.add_argument("--model", choices=["tiny"], help="random weights of a preset and a word-level tokenizer")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the name clients send as 'model' (default: the checkpoint "
                                                    "directory's name, or the preset's)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on /v1 (default: $RFA_API_KEY)")
    parser.add_argument("--cache-gib", type=float, help="the KV cache's budget in GiB (default: --max-batch "
                                                        "sequences of the model's context, within 80%% of free memory)")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache positions per block")
    parser.add_argument("--max-batch", type=int, default=8, help="most sequences in one engine step")
    parser.add_argument("--max-waiting", type=int, default=64,
                        help="most requests waiting for admission; more are refused with 429")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="most tokens of one engine step (chunked prefill): a long prompt is computed in "
                             "chunks; beside the running requests' decode tokens a step holds at most 16 tokens "
                             "(in place, about 3 decode steps' time), alone up to this many (default 512)")
    parser.add_argument("--no-chunked-prefill", action="store_true",
                        help="prefill each prompt whole in a step of its own (the running requests wait)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt whole")
    parser.add_argument("--max-tokens-limit", type=int, help="largest max_tokens a request may ask (default: the "
                                                             "model's context)")
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body (413 past it)")
    parser.add_argument("--max-preparing", type=int, default=64,
                        help="most requests read, parsed and tokenized at once, from before the body is read until "
                             "queued (429 past it; default 64, as --max-waiting: a burst the queue takes is not "
                             "refused before it)")
    parser.add_argument("--allowed-hosts", nargs="+", metavar="HOST",
                        help="the Host names answered (421 otherwise; '*' any; IPv6 in brackets). Default: "
                             "127.0.0.1 localhost [::1] when --host is loopback, else any")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="report usage.prompt_tokens_details.cached_tokens (vLLM's flag): it tells a client "
                             "whether another sent the same prompt prefix, unless they use different cache_salt")
    parser.add_argument("--stream-timeout", type=float, default=30.0,
                        help="seconds a client may leave a stream unread before its request is aborted")
    parser.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a request's body may take to arrive (408 past it)")
    parser.add_argument("--timeout-keep-alive", type=int, default=5, help="seconds an idle connection stays open")
    parser.add_argument("--max-connections", type=int,
                        help="most connections open at once; one more is answered 503 and closed (default: the "
                             "open-files limit, raised to its hard limit, less 128 for the server's own files, at "
                             "most 4096)")
    parser.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a connection has to send a whole request head, from its opening (or the first "
                             "byte of a kept-alive connection's next request); past it, it is closed")
    parser.add_argument("--drain-timeout", type=float, default=300.0,
                        help="on SIGTERM, seconds to wait for running requests before shutting down anyway")
    parser.add_argument("--backend", default="fused", choices=["fused", "auto", "unfused"],
                        help="the attention path: fused (refuse to start without it), auto (fall back, announced "
                             "and counted in rfa:attention_path_total) or unfused")
    parser.add_argument("--seed", type=int, default=0, help="with --model: the random weights' seed")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                        help="under the launcher (msrun) on T ranks: each holds its share of the model and runs it "
                             "in every step; rank 0 serves HTTP (docs/serving.md)")
    parser.add_argument("--tensor-parallel-host", default="127.0.0.1",
                        help="the address rank 0 hands the engine's calls to the other ranks on (default: loopback, "
                             "the ranks of one machine)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def load(args, mesh=None):
    """(model, tokenizer, chat template, served name) for the command line's checkpoint or preset; with a
    tensor-parallel ``mesh``, this rank's share of the model."""
    from ..config import preset
    from ..model import LlamaForCausalLM
    from ..tokenizer import Tokenizer
    from ..weights import load_checkpoint, model_state, read_config, save_hf_checkpoint
    from .chat_template import ChatTemplate

    if args.model:
        ms.set_seed(args.seed)
        config = preset(args.model)
        model = LlamaForCausalLM(config, backend=args.backend)
        if mesh is not None:  # this rank's slices of the one-process model: the weights one process serves
            with tempfile.TemporaryDirectory() as scratch:
                save_hf_checkpoint(model_state(model), config, scratch)
                model = load_checkpoint(scratch, backend=args.backend, parallel=mesh, progress=False)
        return model, Tokenizer.words(config.vocab_size, config.bos_token_id), ChatTemplate.from_directory(None), \
            args.model
    config = read_config(args.checkpoint)[0]
    tokenizer = Tokenizer.from_directory(args.checkpoint, config.bos_token_id)
    if tokenizer is None:
        raise SystemExit(f"{args.checkpoint}: no tokenizer.json or tokenizer.model; the server needs the "
                         "checkpoint's tokenizer")
    model = load_checkpoint(args.checkpoint, backend=args.backend, parallel=mesh)
    return model, tokenizer, ChatTemplate.from_directory(args.checkpoint), Path(args.checkpoint).resolve().name


def generator_options(args, parser) -> dict:
    """``PagedGenerator``'s keyword arguments from the command line."""
    for name in ("max_batch", "max_waiting", "max_num_batched_tokens", "max_tokens_limit", "max_body_bytes",
                 "tensor_parallel", "max_connections", "max_preparing"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive number, got {value}")
    options = dict(block_size=args.block_size, max_batch=args.max_batch, prefix_caching=not args.no_prefix_caching)
    if args.cache_gib is not None:
        options["max_cache_bytes"] = max(1, int(args.cache_gib * GIB))
    options["max_num_batched_tokens"] = None if args.no_chunked_prefill else args.max_num_batched_tokens
    return options


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    generator_kwargs = generator_options(args, parser)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get("RFA_API_KEY") or None

    from .app import Settings, allowed_hosts, create_app
    from .metrics import Metrics
    from .scheduler import EngineService
    from .server import run

    ms.set_device("CPU")
    mesh = None
    if args.tensor_parallel > 1:
        from mindspore.communication import init

        from ms_rope_attention.distributed import ParallelMesh

        init()  # first: msrun's scheduler runs the program up to init()
        mesh = ParallelMesh.create(tensor=args.tensor_parallel, data=1)
    ms.set_context(mode=ms.GRAPH_MODE)
    model, tokenizer, template, name = load(args, mesh)
    name = args.served_model_name or name
    generator = PagedGenerator(model, **generator_kwargs)
    leader = None
    if mesh is not None:
        from .lockstep import Channel, Leader

        tp = model.tensor_parallel
        channel = Channel.open(tp.rank, tp.size, generator.num_blocks, tp.group, host=args.tensor_parallel_host)
        if tp.rank != 0:
            _follow(generator, channel)
            return
        generator = leader = Leader(generator, channel)
    service = EngineService(generator, Metrics(name), max_waiting=args.max_waiting)
    settings = Settings(served_model_name=name, tokenizer=tokenizer, chat_template=template, api_key=api_key,
                        max_body_bytes=args.max_body_bytes, max_tokens_limit=args.max_tokens_limit,
                        send_timeout_s=args.stream_timeout, body_timeout_s=args.body_timeout,
                        max_preparing=args.max_preparing,
                        allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
                        enable_prompt_tokens_details=args.enable_prompt_tokens_details)
    log = logging.getLogger("models.llama.serve")
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key: anyone who reaches it may use it (set RFA_API_KEY)",
                    args.host)
    log.info(
        "serving %r (attention %s, %d KV blocks of %d, chat template %s, API key %s) on http://%s:%d",
        name, model.backend, generator.pool.usable, generator.block_size, template.name,
        "required" if api_key else "not required", args.host, args.port)
    try:
        status = run(create_app(service, settings), service, host=args.host, port=args.port,
                     timeout_keep_alive=args.timeout_keep_alive, drain_timeout_s=args.drain_timeout,
                     max_connections=args.max_connections, header_timeout_s=args.header_timeout,
                     log_level=args.log_level)
    finally:
        if leader is not None:
            service.stop()  # the engine thread has ended (the app's shutdown stopped it): no step in flight
            leader.close()
    if status:  # the engine died (server.ENGINE_DIED): a supervisor restarts the server
        raise SystemExit(status)


def _follow(generator, channel) -> None:
    """A rank past 0: the engine's calls from rank 0 until it stops this rank. A stop signal is rank 0's to
    act on (it drains, then stops the others), so here it is only noted."""
    from .lockstep import follow

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda sig, frame: logging.getLogger("models.llama.serve").info(
            "rank %d: %s: rank 0 drains, then stops this rank", channel.rank, signal.Signals(sig).name))
    follow(generator, channel)


if __name__ == "__main__":
    main()
