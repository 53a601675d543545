"""Issue 52's done-when, outside make test (about a minute): 1,000 requests through the contiguous Generator at
temperature 0.8 and the default top_p (the sampler that crashed on about half its calls), then the
generate CLI with --temperature 0.8 for 20 seeds. The paged engine's 1,000 requests are a test
(tests/test_serving.py::test_a_thousand_sampled_requests_run_without_an_exception).

    .venv/bin/python tests/scripts/sample_thousand.py
"""
import subprocess
import sys
import time

import numpy as np

import ms_rope_attention  # noqa: F401  (before MindSpore: docs/threads.md)
import mindspore as ms
from models.llama import LlamaForCausalLM, preset
from models.llama.engine import Generator

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_seed(0)
model = LlamaForCausalLM(preset("tiny"))
rng = np.random.default_rng(3)
prompts = [rng.integers(0, 256, int(rng.integers(1, 40))).tolist() for _ in range(1000)]
t0 = time.perf_counter()
out = Generator(model, slots=8).generate(prompts, 6, temperature=0.8, seed=11, eos_ids=())
print(f"contiguous Generator: {len(out.tokens)} requests, {sum(map(len, out.tokens))} tokens in "
      f"{time.perf_counter() - t0:.1f} s, no exception")
failed = [seed for seed in range(20) if subprocess.run(
    [sys.executable, "-m", "models.llama.generate", "--model", "tiny", "--ids", "1,15,27", "--max-new-tokens", "16",
     "--temperature", "0.8", "--seed", str(seed)], capture_output=True).returncode != 0]
print(f"generate --temperature 0.8, 20 seeds: {len(failed)} exited non-zero {failed}")
sys.exit(1 if failed else 0)
