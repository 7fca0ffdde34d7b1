"""A P/D engine's serving loop, reduced to what tests of in-process engines need."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from hybridserve import LLM


@contextlib.contextmanager
def polling(llm: LLM) -> Iterator[None]:
    """Poll an engine's transfers in a thread meanwhile (as its serving loop would): a prefill
    engine then writes the pages of push requests, answers handshakes' joins and frees pages on
    the decode side's notifications while the test drives the decode engine."""
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            llm.engine.poll_transfers()
            time.sleep(0.0005)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
