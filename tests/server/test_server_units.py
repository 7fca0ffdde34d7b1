"""Flags and import direction of the server, without a server process."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hybridserve.config import KVTransferConfig, SpeculativeConfig
from hybridserve.server.launch import parse_kv_transfer_config, parse_speculative_config


def test_kv_transfer_config_flag():
    assert parse_kv_transfer_config(None) is None
    config = parse_kv_transfer_config('{"kv_connector":"NixlConnector","kv_role":"kv_producer"}')
    assert config == KVTransferConfig(kv_role="kv_producer")
    with pytest.raises(ValueError, match=r"unknown keys \['kv_rank'\]"):
        parse_kv_transfer_config('{"kv_role":"kv_both","kv_rank":0}')


def test_speculative_config_flag():
    assert parse_speculative_config(None) is None
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="oracle method needs a callable"):
        parse_speculative_config('{"method": "oracle"}')
    with pytest.raises(ValueError, match=r"unknown keys \['draft_model'\]"):
        parse_speculative_config('{"method": "ngram", "draft_model": "x"}')
    with pytest.raises(ValueError, match="1 <= min <= max"):
        parse_speculative_config('{"method": "ngram", "prompt_lookup_min": 5}')


def test_the_engine_never_imports_the_server():
    root = Path(__file__).resolve().parents[2] / "hybridserve"
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] == "server" or rel.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{rel}: {n}" for n in names if n.startswith("hybridserve.server")]
            offenders += [f"{rel}: {n}" for n in names if n.split(".")[0] in ("fastapi", "uvicorn")]
    assert not offenders, offenders


def test_probes_are_logged_at_debug_level_only():
    """uvicorn's access lines of /health and /metrics pass only when debug is on; others pass."""
    import logging

    from hybridserve.server.listener import QuietProbes

    def record(path: str) -> logging.LogRecord:
        args = ("127.0.0.1:5000", "GET", path, "1.1", 200)
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, "%s %s %s", args, None)

    quiet, logger = QuietProbes(), logging.getLogger("uvicorn.access")
    level = logger.level
    try:
        logger.setLevel(logging.INFO)
        assert not quiet.filter(record("/health")) and not quiet.filter(record("/metrics?x=1"))
        assert quiet.filter(record("/v1/completions"))
        logger.setLevel(logging.DEBUG)
        assert quiet.filter(record("/health"))
    finally:
        logger.setLevel(level)
