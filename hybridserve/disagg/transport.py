"""A NIXL agent over the cache regions: registration once, prepared descriptor lists, READ and
WRITE by descriptor index, completion polling and notifications.

The NIXL Python package is `nixl_cu12` on CPU machines (UCX on host memory), `nixl_cu13` or
`nixl` on GPU machines; `import_nixl()` takes whichever is installed. Region buffers are
registered by raw address (JAX buffers do not move: the runner donates them to every step), so
the same memory is read by the model and by remote agents with no copy.

Lifecycle:
  1. `NixlTransport(name, buffers)` creates the agent (UCX) and registers every buffer once.
  2. Peers exchange `metadata()` over the side channel and call `add_peer(metadata)`.
  3. `prepare(descs, peer=None)` prepares a descriptor list once (local, or a peer's memory);
     per request only index lists are built.
  4. `start(op, local, local_ids, remote, remote_ids, notif)` posts a READ or WRITE; `poll`
     reports "DONE", "PROC" or raises on "ERR"; `release` frees the transfer handle.
  5. `notifications()` drains messages from peers; `notify(peer, msg)` sends one.
  6. `close()` releases everything and deregisters the memory.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType
from typing import Any

from hybridserve.disagg.handshake import HandshakeError

NIXL_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")
LOCAL = "NIXL_INIT_AGENT"


class TransferError(RuntimeError):
    """A NIXL transfer failed or NIXL is unusable here."""


def import_nixl() -> ModuleType:
    """The installed NIXL Python API (`nixl`, `nixl_cu13` or `nixl_cu12`)."""
    errors = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError as err:
            errors.append(f"{name}: {err}")
    raise TransferError(
        "NIXL is not installed (pip install -e '.[cpu]' brings nixl-cu12): " + "; ".join(errors)
    )


_CONFIG_LOCK = threading.Lock()


def _make_agent(api: ModuleType, name: str, config: Any, delay_us: int) -> Any:
    """`api.nixl_agent(name, config)` whose progress thread pauses `delay_us` between passes.

    The Python bindings hard-code the pause (`nixlAgentConfig.pthrDelay`) to 0: the thread then
    spins, a whole core per agent (four agents of one process took two cores here). The agent
    is built while the bindings' config class is swapped for a subclass whose `pthrDelay` keeps
    at least `delay_us` (under a lock: only this module builds agents); bindings without that
    field build the agent as they are."""
    bind = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if delay_us <= 0 or base is None or not isinstance(vars(base).get("pthrDelay"), property):
        return api.nixl_agent(name, config)

    class Paused(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 (the bindings' name)
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, max(int(value), delay_us))

    with _CONFIG_LOCK:
        bind.nixlAgentConfig = Paused
        try:
            return api.nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = base


class NixlTransport:
    """One NIXL agent over a fixed set of buffers (see the module docstring).

    Args:
      name: the agent name (unique per worker rank).
      buffers: (address, length, device id) of every region buffer.
      mem_type: "DRAM" for host memory, "VRAM" for GPU memory.
      num_threads: worker threads of the UCX backend that share a transfer's descriptors
        (0: the calling thread posts them all).
      progress_delay_us: the pause of the agent's progress thread between passes (0: it
        spins, one whole core per agent; `_make_agent`).
    """

    def __init__(
        self,
        name: str,
        buffers: list[tuple[int, int, int]],
        mem_type: str = "DRAM",
        num_threads: int = 0,
        progress_delay_us: int = 0,
    ) -> None:
        api = import_nixl()
        self.name, self.mem_type = name, mem_type
        try:
            config = api.nixl_agent_config(backends=["UCX"], num_threads=num_threads)
            self.agent = _make_agent(api, name, config, progress_delay_us)
        except Exception as err:  # the bindings raise plain Exceptions
            raise TransferError(
                f"cannot start a NIXL agent with UCX: {err} (UCX needs `tcp` "
                "among its transports: check UCX_TLS)"
            ) from err
        self._registered = self.agent.register_memory(
            [(addr, length, dev, "") for addr, length, dev in buffers], mem_type
        )
        self._handles: list[Any] = []
        self.peers: set[str] = set()

    def metadata(self) -> bytes:
        """This agent's metadata, for peers' `add_peer`."""
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name."""
        try:
            name = self.agent.add_remote_agent(metadata)
        except Exception as err:
            raise HandshakeError(f"NIXL rejected the peer's agent metadata: {err}") from err
        name = name.decode() if isinstance(name, bytes) else name
        self.peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        """Forget a peer's metadata (its prepared lists must be released first)."""
        if name in self.peers:
            self.peers.discard(name)
            self.agent.remove_remote_agent(name)

    def prepare(self, descs: list[tuple[int, int, int]], peer: str | None = None) -> Any:
        """Prepare a descriptor list once: local memory, or `peer`'s memory. Raises
        TransferError when NIXL refuses it (e.g. memory the peer never registered)."""
        try:
            handle = self.agent.prep_xfer_dlist(peer or LOCAL, descs, self.mem_type)
        except Exception as err:  # the bindings raise plain Exceptions
            raise TransferError(f"NIXL refused a descriptor list: {err}") from err
        self._handles.append(handle)
        return handle

    def release_prepared(self, handles: list[Any]) -> None:
        """Release prepared lists before `close` (those of a peer that is dropped)."""
        for handle in handles:
            if handle in self._handles:
                self._handles.remove(handle)
                handle.release()

    def start(
        self,
        op: str,
        local: Any,
        local_ids: list[int],
        remote: Any,
        remote_ids: list[int],
        notif: bytes = b"",
    ) -> Any:
        """Post a READ (pull remote -> local) or WRITE (push local -> remote)."""
        if op not in ("READ", "WRITE"):
            raise ValueError(f"op must be READ or WRITE, got {op!r}")
        if len(local_ids) != len(remote_ids):
            raise ValueError(f"{len(local_ids)} local descriptors but {len(remote_ids)} remote")
        try:
            xfer = self.agent.make_prepped_xfer(op, local, local_ids, remote, remote_ids, notif)
        except Exception as err:  # ids out of the lists' range, or a peer NIXL dropped
            raise TransferError(f"NIXL refused the {op}: {err}") from err
        try:
            state = self.agent.transfer(xfer)
        except Exception:
            state = "ERR"
        if state == "ERR":
            self.agent.release_xfer_handle(xfer)
            raise TransferError(f"NIXL could not post the {op}")
        return xfer

    def poll(self, xfer: Any) -> str:
        """ "DONE" or "PROC"; raises TransferError when the transfer failed."""
        try:
            state = self.agent.check_xfer_state(xfer)
        except Exception as err:
            raise TransferError(f"NIXL transfer failed: {err}") from err
        if state == "ERR":
            raise TransferError("NIXL transfer failed")
        return state

    def backend_of(self, xfer: Any) -> str:
        """The backend NIXL chose for a transfer (e.g. "UCX")."""
        return self.agent.query_xfer_backend(xfer)

    def release(self, xfer: Any) -> None:
        self.agent.release_xfer_handle(xfer)

    def notifications(self) -> dict[str, list[bytes]]:
        """New notification messages, by sending agent name."""
        notes = self.agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else k): v for k, v in notes.items()}

    def notify(self, peer: str, message: bytes) -> None:
        try:
            self.agent.send_notif(peer, message)
        except Exception as err:
            raise TransferError(f"cannot notify {peer}: {err}") from err

    def close(self) -> None:
        """Release prepared lists, deregister the memory and drop the agent (idempotent). The
        agent's progress thread polls without pause while the agent lives, so an agent left
        open costs a share of a core until the process ends."""
        if self.agent is None:
            return
        for handle in self._handles:
            handle.release()
        self._handles.clear()
        if self._registered is not None:
            self.agent.deregister_memory(self._registered)
            self._registered = None
        self.agent = None
