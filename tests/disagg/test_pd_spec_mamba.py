"""Speculative decoding on a Mamba hybrid under P/D (the shipped nemotron_h model, real NIXL
over UCX on host memory): the decode engine receives the KV pages and Mamba states, then drafts
(an oracle replaying plain greedy output with some drafts wrong) and verifies, keeping its Mamba
states before the drafts (tests/hybridserve/test_spec_mamba.py for the colocated case)."""

from __future__ import annotations

from hybridserve import LLM
from hybridserve.config import KVTransferConfig
from tests.disagg.test_pd_engines import _pd_generate
from tests.hybridserve.test_spec_mamba import (  # noqa: F401 (fixtures)
    GREEDY,
    SETTINGS,
    K,
    _oracle,
    _prompts,
    plain,
    plain_llm,
)


def _role(kv_role: str) -> KVTransferConfig:
    return KVTransferConfig(kv_role=kv_role, lease_s=600.0)


def test_speculation_on_a_mamba_hybrid_under_pd_equals_plain(plain):  # noqa: F811
    spec = {"method": "oracle", "num_speculative_tokens": K, "oracle": _oracle(plain, 3)}
    prefill = LLM(**SETTINGS, progress=False, kv_transfer_config=_role("kv_producer"))
    decode = LLM(
        **SETTINGS, progress=False, kv_transfer_config=_role("kv_consumer"), speculative_config=spec
    )
    with prefill, decode:
        assert _pd_generate(prefill, decode, _prompts(), GREEDY) == plain
        s = decode.engine.stats()
        assert 0 < s["spec_num_accepted"] < s["spec_num_drafts"]
        for engine in (prefill.engine, decode.engine):
            assert engine.scheduler.coordinator.pool.num_used == 0


def test_mtp_layers_of_a_mamba_hybrid_under_pd_equal_plain(plain, tmp_path):  # noqa: F811
    # Nemotron-H's MTP layers (`nemotron_mtp`) on the decode side, both sides from the same
    # checkpoint (their caches hold the MTP step's attention as well).
    from tests.hybridserve.nemotron_mtp import write_nemotron_mtp

    path = write_nemotron_mtp(tmp_path / "m", mimic=0.95)
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    prefill = LLM(path, **SETTINGS, progress=False, kv_transfer_config=_role("kv_producer"))
    decode = LLM(path, **SETTINGS, progress=False, kv_transfer_config=_role("kv_consumer"),
                 speculative_config=spec)  # fmt: skip
    with prefill, decode:
        assert _pd_generate(prefill, decode, _prompts(), GREEDY) == plain
        s = decode.engine.stats()
        assert s["spec_num_drafts"] > 0
        for engine in (prefill.engine, decode.engine):
            assert engine.scheduler.coordinator.pool.num_used == 0
