"""Live prefill and decode engines with a shared secret, against forged parameters, rogue
handshakes and a rogue NIXL agent: everything hostile is refused at the boundary (no
connection made, no metadata given, no page released), fuzzing with hypothesis never ends an
engine, and afterwards P/D still gives the colocated greedy tokens.

One module-scoped pair of engines (the programs compile once); the fuzzers run 2,000 cases
each."""

from __future__ import annotations

import contextlib
import copy
import socket
import struct
import time

import msgpack
import numpy as np
import pytest
from engine_shapes import TINY
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pd_polling import polling

from hybridserve import LLM, SamplingParams
from hybridserve.config import KVTransferConfig
from hybridserve.disagg.handshake import VERSION, HandshakeError, fetch_peer
from hybridserve.disagg.notes import encode_note
from hybridserve.disagg.params import Forbidden, TransferParams
from hybridserve.disagg.transport import NixlTransport

SECRET = "the deployment's shared secret"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
FUZZ = settings(
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)


def _llm(directory, role, **kv):
    config = KVTransferConfig(kv_role=role, secret=SECRET, lease_s=600.0, **kv)
    return LLM(directory, **TINY, progress=False, kv_transfer_config=config)


@pytest.fixture(scope="module")
def pair(hf_checkpoint):
    directory = hf_checkpoint("nemotron_h")[0]
    prefill, decode = _llm(directory, "kv_producer"), _llm(directory, "kv_consumer")
    cold = LLM(directory, **TINY, progress=False)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(10, 500, n).tolist() for n in (21, 34)]
    expected = [
        o.outputs[0].token_ids
        for o in cold.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    ]
    yield prefill, decode, prompts, expected
    prefill.close()
    decode.close()


def _prefill(prefill: LLM, prompt: list[int]) -> dict:
    (out,) = prefill.generate(
        [{"prompt_token_ids": prompt, "kv_transfer_params": {"do_remote_decode": True}}],
        GREEDY,
        use_tqdm=False,
    )
    return out.kv_transfer_params


def _pd(pair) -> list[list[int]]:
    """Every prompt through prefill then decode: the tokens."""
    prefill, decode, prompts, _ = pair
    handed = [_prefill(prefill, p) for p in prompts]
    with polling(prefill):
        outs = decode.generate(
            [
                {"prompt_token_ids": p, "kv_transfer_params": h}
                for p, h in zip(prompts, handed, strict=True)
            ],
            GREEDY,
            use_tqdm=False,
        )
    assert decode.engine.stats()["transfer_failures"] == 0
    return [o.outputs[0].token_ids for o in outs]


def _assert_stillpolling(pair) -> None:
    prefill, decode, _, expected = pair
    failures = decode.engine.stats()["transfer_failures"]
    assert _pd(pair) == expected
    assert decode.engine.stats()["transfer_failures"] == failures
    for llm in (prefill, decode):
        llm.engine.poll_transfers()
        assert not llm.engine.scheduler.requests


def test_signed_params_give_the_colocated_tokens(pair):
    _assert_stillpolling(pair)
    prefill, decode, _, _ = pair
    assert not prefill.engine.scheduler.held  # every held page was read and released


def test_forged_expired_replayed_and_foreign_params_are_refused_without_a_connection(pair):
    prefill, decode, prompts, _ = pair
    engine, server = decode.engine, prefill.engine.connector.server
    victim = _prefill(prefill, prompts[0])
    mine = _prefill(prefill, prompts[1])
    served = server.num_served
    forged = [
        {**mine, "block_tables": victim["block_tables"]},  # my lease, the victim's pages
        {**mine, "port": 1},  # a foreign host:port
        {**mine, "host": "10.0.0.1"},
        {**mine, "signature": ""},
        {**mine, "expires": mine["expires"] + 3600},
        {**victim, "req_id": mine["req_id"]},
    ]
    for i, params in enumerate(forged):
        with pytest.raises(Forbidden, match="signature"):
            engine.add_request(prompts[1], GREEDY, f"forged-{i}", kv_transfer_params=params)
    with pytest.raises(Forbidden, match="different prompt"):  # the victim's params, my prompt
        engine.add_request(prompts[1], GREEDY, "stolen", kv_transfer_params=victim)
    with pytest.raises(Forbidden, match="expired"):
        TransferParams.parse(mine, len(prompts[1]) + 1).verify(
            SECRET.encode(), prompts[1], now=mine["expires"] + 1
        )
    assert not engine.connector.consumer.directory.pending and server.num_served == served
    # the genuine ones still work, once each
    with polling(prefill):
        for name, p, params in (("v", prompts[0], victim), ("m", prompts[1], mine)):
            engine.add_request(p, GREEDY, name, kv_transfer_params=params)
            with pytest.raises(Forbidden, match="replayed"):
                engine.add_request(p, GREEDY, f"{name}-again", kv_transfer_params=params)
        while engine.has_unfinished():
            engine.step()
    assert not prefill.engine.scheduler.held


def test_a_handshake_without_the_secret_gets_no_metadata(pair):
    prefill, _, _, _ = pair
    server = prefill.engine.connector.server
    served = server.num_served
    for secret in (None, b"not the secret of this deployment"):
        with pytest.raises(HandshakeError, match="authentication failed"):
            fetch_peer(server.host, server.port, {}, timeout=2.0, secret=secret)
    assert server.num_served == served


def _rogue(pair) -> NixlTransport:
    """A NIXL agent of an authenticated but malicious peer, joined to the prefill engine."""
    prefill, decode, _, _ = pair
    buffer = np.zeros(1 << 16, np.uint8)
    rogue = NixlTransport(
        "rogue:0", [(buffer.ctypes.data, buffer.nbytes, 0)], "DRAM", progress_delay_us=1000
    )
    rogue._buffer = buffer  # keep it alive as long as the agent
    server = prefill.engine.connector.server
    request = decode.engine.connector.consumer._handshake_request()
    request.update(agent_name="rogue:0", agent_metadata=rogue.metadata())
    info = fetch_peer(server.host, server.port, request, secret=SECRET.encode())
    rogue.add_peer(info["agent_metadata"])
    rogue.add_peer(decode.engine.connector.transport.metadata())
    return rogue


_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)


def test_fuzzed_notifications_from_a_rogue_agent_end_nothing(pair):
    prefill, decode, prompts, _ = pair
    rogue = _rogue(pair)
    held = _prefill(prefill, prompts[0])  # a request the rogue knows but has no cap for
    targets = [prefill.engine.connector.agent_name, decode.engine.connector.agent_name]
    ops = ["read", "read_ack", "push", "pushed", "keep", "release", "nope", 3]
    reqs = st.sampled_from([held["req_id"], "", "x", "req-0"]) | st.text(max_size=8)
    sent = []

    @FUZZ
    @given(
        st.sampled_from(ops),
        reqs,
        st.dictionaries(
            st.sampled_from(
                ["dst", "cap", "ok", "error", "part", "parts", "tables", "fill", "tokens", "reqs"]
            ),
            _value | st.lists(st.lists(st.integers(0, 60), max_size=4), max_size=3),
            max_size=6,
        ),
        st.sampled_from(targets),
        st.booleans(),
    )
    def fuzz(op, req, fields, target, raw):
        if raw:  # not even msgpack
            message = msgpack.packb(fields, use_bin_type=True)[::-1]
        else:
            message = msgpack.packb({"op": op, "req": req, **fields}, use_bin_type=True)
        rogue.notify(target, message)
        sent.append(message)
        if len(sent) % 50 == 0:
            prefill.engine.poll_transfers()
            decode.engine.poll_transfers()

    try:
        fuzz()
        for note in ("read", "release", "push"):  # the right op, the wrong capability
            rogue.notify(targets[0], encode_note(note, held["req_id"], dst="d", cap="0" * 64))
        time.sleep(0.2)
        prefill.engine.poll_transfers()
        decode.engine.poll_transfers()
        assert len(sent) >= 2000
        assert held["req_id"] in prefill.engine.scheduler.held  # nothing released it
        prefill.engine.release_kv(held)
        prefill.engine.poll_transfers()
        assert held["req_id"] not in prefill.engine.scheduler.held
        assert prefill.engine.stats()["refused_notes"] > 0
    finally:
        rogue.close()
    _assert_stillpolling(pair)


def _exchange(server, frames: list[bytes]) -> bytes:
    """Send raw bytes after the server's hello, end our side, read what comes back."""
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        (n,) = struct.unpack(">I", sock.recv(4))
        hello = b""
        while len(hello) < n:
            hello += sock.recv(n - len(hello))
        reply = b""
        with contextlib.suppress(OSError):  # the server closed early, our bytes unread
            for frame in frames:
                sock.sendall(frame)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(1 << 16):
                reply += chunk
    return reply


def _frame(obj) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def test_fuzzed_handshake_frames_end_nothing(pair):
    prefill, decode, _, _ = pair
    server = prefill.engine.connector.server
    served = server.num_served

    @FUZZ
    @given(
        st.one_of(
            st.binary(max_size=64),
            _value.map(_frame),
            st.dictionaries(st.sampled_from(["version", "nonce", "proof", "layout"]), _value).map(
                lambda d: _frame({"version": VERSION, **d})
            ),
        ),
        st.binary(max_size=16),
    )
    def fuzz(frame, tail):
        reply = _exchange(server, [frame, tail])
        assert b"agent_metadata" not in reply and b"layouts" not in reply

    fuzz()
    assert server.num_served == served
    # an authenticated peer that sends garbage metadata is dropped by the engine thread
    request = decode.engine.connector.consumer._handshake_request()
    request.update(agent_name="junk:0", agent_metadata=b"\x00garbage metadata")
    fetch_peer(server.host, server.port, request, secret=SECRET.encode())
    failures = prefill.engine.connector.join_failures
    prefill.engine.poll_transfers()
    assert prefill.engine.connector.join_failures == failures + 1
    _assert_stillpolling(pair)


def test_fuzzed_kv_transfer_params_end_nothing(pair):
    prefill, decode, prompts, _ = pair
    genuine = _prefill(prefill, prompts[0])
    engine = decode.engine
    keys = list(genuine)
    refused = []

    @FUZZ
    @given(
        st.lists(st.tuples(st.sampled_from([*keys, "other"]), _value), min_size=1, max_size=3),
        st.booleans(),
    )
    def fuzz(changes, drop):
        params = copy.deepcopy(genuine)
        for key, value in changes:
            if drop:
                params.pop(key, None)
            else:
                params[key] = value
        if params == genuine:
            return
        try:
            engine.add_request(prompts[0], GREEDY, "fuzz", kv_transfer_params=params)
        except ValueError as err:  # Forbidden included
            refused.append(type(err).__name__)
            return
        # what passes: a change to a field the signature does not cover ("other"), or params
        # without block tables (no transfer: the decode engine prefills locally)
        assert "block_tables" not in params or set(params) - set(genuine)
        engine.abort_request("fuzz")

    fuzz()
    assert len(refused) > 1000
    with polling(prefill):  # an accepted one aborted mid-transfer ends with its transfer
        deadline = time.monotonic() + 30
        while engine.has_unfinished() and time.monotonic() < deadline:
            engine.step()
    assert not engine.scheduler.requests and engine.scheduler.coordinator.pool.num_used == 0
    prefill.engine.release_kv(genuine)
    prefill.engine.poll_transfers()
    _assert_stillpolling(pair)


def test_a_restarted_prefill_engine_is_a_new_peer(pair, hf_checkpoint):
    """A prefill engine restarted at the same address and engine id: parameters of the old
    process fail with a reason (its pages are gone) and recompute, and the new process's
    parameters are served after a fresh handshake, with nothing refused by NIXL."""
    _, decode, prompts, expected = pair
    directory = hf_checkpoint("nemotron_h")[0]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    kv = {"engine_id": "restarted", "port": port}
    first = _llm(directory, "kv_producer", **kv)
    old = _prefill(first, prompts[0])
    with polling(first):  # the decode engine learns the first process
        decode.generate(
            [{"prompt_token_ids": prompts[0], "kv_transfer_params": old}], GREEDY, use_tqdm=False
        )
    old = _prefill(first, prompts[0])
    first.close()
    second = _llm(directory, "kv_producer", **kv)
    try:
        new = _prefill(second, prompts[1])
        assert new["epoch"] != old["epoch"] and new["port"] == old["port"]
        failures = decode.engine.stats()["transfer_failures"]
        with polling(second):
            outs = decode.generate(
                [
                    {"prompt_token_ids": prompts[0], "kv_transfer_params": old},
                    {"prompt_token_ids": prompts[1], "kv_transfer_params": new},
                ],
                GREEDY,
                use_tqdm=False,
            )
        assert [o.outputs[0].token_ids for o in outs] == expected  # the old one recomputed
        assert decode.engine.stats()["transfer_failures"] == failures + 1
        assert not second.engine.scheduler.held
    finally:
        second.close()
