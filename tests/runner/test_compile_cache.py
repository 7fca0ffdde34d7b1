"""`runner.compile_cache.enable_compilation_cache`: every program is stored, whether the
directory is ours or came from `$JAX_COMPILATION_CACHE_DIR` (a fresh process each: jax reads
these settings once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, jax
from hybridserve.runner.compile_cache import enable_compilation_cache
where = enable_compilation_cache()
print(json.dumps([None if where is None else str(where), jax.config.jax_compilation_cache_dir,
                  jax.config.jax_persistent_cache_min_compile_time_secs]))
"""


def _probe(env: dict[str, str]) -> list:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "HYBRIDSERVE_"))}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**base, "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("var", ["JAX_COMPILATION_CACHE_DIR", "HYBRIDSERVE_COMPILATION_CACHE"])
def test_every_program_is_stored_wherever_the_directory_came_from(tmp_path, var):
    where, configured, min_secs = _probe({var: str(tmp_path)})
    assert where == configured == str(tmp_path) and min_secs == 0.0


def test_the_users_minimum_compile_time_rules_and_off_means_off(tmp_path):
    env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path)}
    assert _probe(env | {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"})[2] == 2.0
    assert _probe({"HYBRIDSERVE_COMPILATION_CACHE": "off"})[:2] == [None, None]
