"""Test configuration: four host devices for tensor-parallel tests, and tiny HF checkpoints."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Must happen before jax is imported anywhere in the session.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


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
