"""Started by every Python the tests start (conftest puts this folder on PYTHONPATH); acts only in
vLLM's environment (.venv-vllm), and only on the test machine.

vLLM calls `gc.collect()` six to eight times for every engine it builds and shuts down (after loading
weights, after freeing the profiling KV cache, at shutdown, around freezing its heap). With torch,
transformers and vLLM imported, the heap holds about a million objects: each full collection costs
0.5-1 s on CI's cores, three quarters of serving a tiny model (py-spy, test_serve_vllm's driver,
which serves 40 models in one process). Here those calls collect the young generations only; the
interpreter's own full collections still run when the old generation grows. Nothing a test asserts
depends on when a cycle is freed: served tokens, logprobs, imports, refusals and sizes are the same.
Users' vLLM is untouched.
"""

import gc
import sys
from pathlib import Path

if Path(sys.prefix).name == ".venv-vllm":
    _collect = gc.collect

    def _young_generations(generation: int = 2) -> int:
        return _collect(min(generation, 1))

    gc.collect = _young_generations
