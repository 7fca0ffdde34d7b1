"""Test configuration: four host devices for tensor-parallel tests, a persistent compilation
cache, and tiny HF checkpoints.

The suite builds many engines over the same few tiny models, in the test processes and in the
worker, server and notebook processes they start; each engine jits its own step functions, so
without a cache every one of them compiles the same XLA programs again. JAX's persistent
compilation cache (keyed by the program, its devices and compile options) lets every process
after the first load them instead. Every program is kept, however quickly it compiled: the
eager ops of building models and of the op tests (random initialisers, casts) compile anew in
every process otherwise, and they add up (a sixth of one module's time). The environment
variables set here reach every process the tests start. `HYBRIDSERVE_TEST_JAX_CACHE=0` turns
the cache off.

`tests/engine_shapes.py` keeps the engines of different tests on the same settings, so that
they share programs; `duration_guard.py` fails a run that exceeds the suite's time budget.
"""

from __future__ import annotations

import getpass
import os
import sys
import tempfile
from pathlib import Path

# Must happen before jax is imported anywhere in the session (the workers and servers that
# tests start inherit it). LLVM at -O0: the suite compiles hundreds of small programs and runs
# each a few times, so compiling faster (about 20% a cold file) beats running faster.
for flag in ("--xla_force_host_platform_device_count=4", "--xla_backend_optimization_level=0"):
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Engines compile their programs on first use in the tests (a start-up warmup per engine setting
# would compile programs no test runs); tests of the warmup ask for it.
os.environ.setdefault("HYBRIDSERVE_WARMUP", "0")
if os.environ.get("HYBRIDSERVE_TEST_JAX_CACHE", "1") != "0":
    cache = Path(tempfile.gettempdir()) / f"hybridserve-test-jax-cache-{getpass.getuser()}"
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
from duration_guard import DurationGuard, limit_from_env  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """The time budget (`duration_guard`), in the controlling process only."""
    limit = limit_from_env()
    if limit is not None and not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationGuard(limit), "duration_guard")


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """`hf_checkpoint(family)` -> (directory, transformers model), built once per family."""
    import hf_models
    import torch

    torch.set_num_threads(2)
    built: dict[str, tuple[Path, object]] = {}

    def get(family: str):
        if family not in built:
            directory = tmp_path_factory.mktemp(family)
            model = hf_models.build(hf_models.FAMILIES[family](), directory)
            built[family] = (directory, model)
        return built[family]

    return get


# The tiny ModelOpt FP8 checkpoints (modelopt_fp8): the Nano FP8 recipe in miniature. Layer 3
# (attention) and layer 2 (the Mamba2 layer before it) stay high precision, layer 6 (attention)
# is FP8, so both kinds of attention block and of Mamba2 block run; conv1d is never quantised.
FP8_EXCLUDE = ["backbone.layers.2.mixer*", "backbone.layers.3.mixer*", "*conv1d*"]


@pytest.fixture(scope="session")
def fp8_checkpoint(hf_checkpoint, tmp_path_factory):
    """`fp8_checkpoint(kv)` -> (directory, reference): the nemotron_h checkpoint in ModelOpt FP8
    form (with FP8 KV scales when `kv`), and a copy of its transformers model that computes as
    the checkpoint does (`modelopt_fp8.fp8_reference`), built once per `kv`."""
    import copy

    import modelopt_fp8
    import numpy as np
    import torch

    src, hf = hf_checkpoint("nemotron_h")
    built: dict[bool, tuple[Path, object]] = {}

    def get(kv: bool):
        if kv not in built:
            dst = tmp_path_factory.mktemp(f"nemotron_h_fp8_kv{int(kv)}")
            calib = torch.as_tensor(np.random.default_rng(7).integers(3, 512, size=(4, 24)))
            modelopt_fp8.write_modelopt_fp8(hf, src, dst, calib, FP8_EXCLUDE, kv=kv)
            ref = copy.deepcopy(hf)
            modelopt_fp8.fp8_reference(ref, dst, kv=kv)
            built[kv] = (dst, ref)
        return built[kv]

    return get
