"""Ready means compiled: an engine's start-up warmup compiles every step program and the small
programs between the steps, so the first request compiles nothing; and JAX's persistent cache
(on by default) lets a second start load them all instead of compiling.

Programs are counted with jax's monitoring events (each program that reaches the backend, and
whether the persistent cache had it), not timed; `BENCHMARKS.md` has the start-up times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, time
import jax
from jax import monitoring
events = {"programs": 0, "compiled": 0, "loaded": 0}
def on_duration(name, secs, **kw):
    if name == "/jax/core/compile/backend_compile_duration":  # compiled or loaded
        events["programs"] += 1
def on_event(name, **kw):
    if name == "/jax/compilation_cache/cache_misses":
        events["compiled"] += 1
    if name == "/jax/compilation_cache/cache_hits":
        events["loaded"] += 1
monitoring.register_event_duration_secs_listener(on_duration)
monitoring.register_event_listener(on_event)
from hybridserve import LLM, SamplingParams
start = time.perf_counter()
llm = LLM(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64,
          max_prefill_chunk=32, progress=False)
ready_s = time.perf_counter() - start
at_ready = dict(events)
out = llm.generate(["def read(path):", "import os"],
                   [SamplingParams(max_tokens=4, temperature=0),
                    SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=1)],
                   use_tqdm=False)
print(json.dumps({"ready_s": ready_s, "at_ready": at_ready, "after": events,
                  "tokens": [o.outputs[0].token_ids for o in out]}))
"""


def _start(cache: Path) -> dict:
    env = {**os.environ, "HYBRIDSERVE_WARMUP": "1", "HYBRIDSERVE_COMPILATION_CACHE": str(cache)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the suite's shared cache: not this test's
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_first_requests_compile_nothing_and_a_second_start_loads_everything(tmp_path):
    first = _start(tmp_path / "cache")
    assert first["at_ready"]["compiled"] > 10  # the warmup compiled the step programs
    assert first["after"] == first["at_ready"], "the first requests compiled something"
    second = _start(tmp_path / "cache")
    assert second["at_ready"]["compiled"] == 0, "a second start compiled instead of loading"
    assert second["at_ready"]["loaded"] == second["at_ready"]["programs"] > 10
    assert second["after"] == second["at_ready"]
    assert second["tokens"] == first["tokens"]
    assert any((tmp_path / "cache").iterdir())
