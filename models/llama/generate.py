"""Text generation with a rotated KV cache: prefill through the fused op (which emits the rotated
keys for the cache), then one-token decode steps attending to the cache with ``key_rotated``.

Prefill and decode are two graphs compiled once each for any prompt length (dynamic shapes).
Equal-length batches use the BSH layout; a model built with ``layout="TND"`` takes prompts of
different lengths with no padding.

    python -m models.llama.generate --checkpoint DIR --prompt "The capital of France is"
    python -m models.llama.generate --model tiny --ids 1,15,27 --max-new-tokens 8
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from .model import LlamaForCausalLM


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0) -> np.ndarray:
    """Next token per row of ``logits`` (B, vocab): greedy at temperature 0, else sampled from the
    temperature-scaled distribution restricted to the top_k tokens and the top_p probability mass."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"sampling: expected temperature >= 0, 0 < top_p <= 1, top_k >= 0; got {temperature}, "
                         f"{top_p}, {top_k}")
    if temperature == 0:
        return logits.argmax(-1)
    out = np.empty(logits.shape[0], np.int64)
    for b, row in enumerate(logits.astype(np.float64) / temperature):
        order = np.argsort(-row, kind="stable")
        if top_k:
            order = order[:top_k]
        probs = np.exp(row[order] - row[order[0]])
        probs /= probs.sum()
        keep = np.searchsorted(np.cumsum(probs), top_p) + 1  # smallest prefix holding top_p of the mass
        probs = probs[:keep] / probs[:keep].sum()
        out[b] = order[rng.choice(keep, p=probs)]
    return out


class _Prefill(nn.Cell):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def construct(self, input_ids, actual_seq_qlen=None, actual_seq_kvlen=None):
        return self.lm(input_ids, None, None, None, None, actual_seq_qlen, actual_seq_kvlen)


class _Step(nn.Cell):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def construct(self, input_ids, keys, values, positions, cache_index=None, actual_seq_qlen=None,
                  actual_seq_kvlen=None):
        return self.lm(input_ids, keys, values, positions, cache_index, actual_seq_qlen, actual_seq_kvlen)


def _dyn(shape, dtype):
    return Tensor(shape=shape, dtype=dtype)


@dataclass
class Generation:
    tokens: list[list[int]]       # generated ids per prompt (up to and including EOS)
    ttft_s: float                 # prefill + first token
    decode_tokens_per_s: float    # per sequence, over the decode steps
    compile_s: float              # first call: compile + warm-up of both graphs, kept out of TTFT


class Generator:
    """Drives a ``LlamaForCausalLM`` (built with ``logits="last"``) through prefill and decode."""

    def __init__(self, model: LlamaForCausalLM, dynamic: bool = True):
        if not model.last_only:
            raise ValueError("model: build it with logits='last' for generation")
        self.model = model
        self.prefill = _Prefill(model)
        self.step = _Step(model)
        cfg = model.config
        layers, kv_heads, head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.dim_per_head
        dtype = model.model.embed_tokens.weight.dtype
        if dynamic:  # one graph for every prompt length and cache length
            i64 = ms.int64
            if model.layout == "BSH":
                self.prefill.set_inputs(_dyn([None, None], ms.int32))
                cache = _dyn([layers, None, None, kv_heads * head_dim], dtype)
                self.step.set_inputs(_dyn([None, None], ms.int32), cache, cache, _dyn([None], i64))
            else:
                self.prefill.set_inputs(_dyn([None], ms.int32), _dyn([None], i64), _dyn([None], i64))
                cache = _dyn([layers, None, kv_heads, head_dim], dtype)
                self.step.set_inputs(_dyn([None], ms.int32), cache, cache, _dyn([None], i64), _dyn([None], i64),
                                     _dyn([None], i64), _dyn([None], i64))
        self._compiled = False

    def prefill_logits(self, prompts: list[list[int]]):
        """(last-token logits (B, vocab) as numpy, keys, values) for the prompts."""
        if self.model.layout == "BSH":
            if len({len(p) for p in prompts}) != 1:
                raise ValueError("prompts: different lengths need a model built with layout='TND' (no padding)")
            logits, keys, values = self.prefill(Tensor(np.array(prompts, np.int32)))
            return logits.asnumpy()[:, -1], keys, values
        ends = Tensor(np.cumsum([len(p) for p in prompts]), ms.int64)
        logits, keys, values = self.prefill(Tensor(np.concatenate(prompts).astype(np.int32)), ends, ends)
        return logits.asnumpy(), keys, values

    def step_logits(self, tokens: np.ndarray, keys, values, lengths: np.ndarray):
        """One decode step: ``tokens`` (B,) at positions ``lengths`` (tokens already cached per sequence)."""
        if self.model.layout == "BSH":
            logits, keys, values = self.step(Tensor(tokens[:, None].astype(np.int32)), keys, values,
                                             Tensor(lengths[:1].astype(np.int64)))
            return logits.asnumpy()[:, -1], keys, values
        batch = len(tokens)
        old_ends = np.cumsum(lengths)
        starts = old_ends - lengths
        cache_index = np.concatenate([np.append(np.arange(s, e), old_ends[-1] + b)
                                      for b, (s, e) in enumerate(zip(starts, old_ends))])
        logits, keys, values = self.step(Tensor(tokens.astype(np.int32)), keys, values,
                                         Tensor(lengths.astype(np.int64)), Tensor(cache_index.astype(np.int64)),
                                         Tensor(np.arange(1, batch + 1), ms.int64),
                                         Tensor(old_ends + np.arange(1, batch + 1), ms.int64))
        return logits.asnumpy(), keys, values

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 32, *, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_ids=None) -> Generation:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: expected at least one non-empty prompt")
        longest = max(len(p) for p in prompts) + max_new_tokens
        if longest > self.model.max_positions:
            raise ValueError(f"max_new_tokens: prompt + {max_new_tokens} new tokens reach position {longest}, beyond "
                             f"the model's cos/sin cache of {self.model.max_positions} positions")
        eos = set(self.model.config.eos_token_ids if eos_ids is None else eos_ids)
        rng = np.random.default_rng(seed)
        compile_s = 0.0
        if not self._compiled:  # compile (and warm up) both graphs on real shapes; timed separately
            t0 = time.perf_counter()
            logits, keys, values = self.prefill_logits(prompts)
            self.step_logits(logits.argmax(-1), keys, values, np.array([len(p) for p in prompts], np.int64))
            compile_s = time.perf_counter() - t0
            self._compiled = True
        t0 = time.perf_counter()
        logits, keys, values = self.prefill_logits(prompts)
        token = sample(logits, rng, temperature, top_k, top_p)
        ttft = time.perf_counter() - t0
        out = [[int(t)] for t in token]
        done = np.array([t in eos for t in token])
        lengths = np.array([len(p) for p in prompts], np.int64)
        t1 = time.perf_counter()
        steps = 0
        while steps + 1 < max_new_tokens and not done.all():
            logits, keys, values = self.step_logits(token, keys, values, lengths)
            lengths = lengths + 1
            token = sample(logits, rng, temperature, top_k, top_p)
            steps += 1
            for b, t in enumerate(token):
                if not done[b]:
                    out[b].append(int(t))
                    done[b] = t in eos
        decode_s = time.perf_counter() - t1
        return Generation(out, ttft, steps / decode_s if steps else 0.0, compile_s)


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
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--backend", default="auto", choices=["auto", "fused", "unfused"])
    parser.add_argument("--mode", default="graph", choices=["graph", "pynative"])
    parser.add_argument("--device", default="CPU")
    args = parser.parse_args(argv)
    ms.set_device(args.device)
    ms.set_context(mode=ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE)

    from .config import preset
    from .tokenizer import Tokenizer
    from .weights import load_checkpoint, read_config

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
    kwargs = dict(dtype=args.dtype, backend=args.backend, logits="last",
                  layout="TND" if len({len(p) for p in prompts}) > 1 else "BSH")
    if args.checkpoint:
        model = load_checkpoint(args.checkpoint, **kwargs)
    else:
        model = LlamaForCausalLM(config.replace(num_hidden_layers=args.layers) if args.layers else config, **kwargs)
    result = Generator(model).generate(prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                       top_p=args.top_p, seed=args.seed)
    for prompt, tokens in zip(prompts, result.tokens):
        text = tokenizer.decode(tokens) if tokenizer else ""
        print(f"prompt ids {prompt} -> {tokens}" + (f"\n{text}" if text else ""))
    print(f"backend {model.backend}; TTFT {result.ttft_s * 1e3:.1f} ms (compile {result.compile_s:.1f} s "
          f"excluded); decode {result.decode_tokens_per_s:.1f} tokens/s per sequence")


if __name__ == "__main__":
    main()
