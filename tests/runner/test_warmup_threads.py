"""`runner.programs.warmup` compiles its programs side by side (`compile_threads` threads), and
the first runs after it reuse them: each program is handed to the backend once."""

from __future__ import annotations

import threading

import pytest

from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.runner import factory
from hybridserve.runner.compile_cache import enable_compilation_cache, programs
from hybridserve.runner.programs import COMPILE_THREADS_ENV, compile_threads, shapes

SETTINGS = dict(dtype="float32", max_model_len=256, max_num_seqs=2, max_prefill_chunk=32)


def test_warmup_compiles_each_program_once_on_threads(monkeypatch):
    monkeypatch.setenv(COMPILE_THREADS_ENV, "2")
    enable_compilation_cache()  # starts the counts of `programs()`, as an engine does
    runner = factory.make_runner(str(DEFAULT_MODEL), **SETTINGS)
    threads, compile_step = [], runner.compile_step

    def spy(batch):
        threads.append(threading.current_thread().name)
        return compile_step(batch)

    runner.compile_step = spy
    todo = shapes(2, 32, runner.pack_limits)
    before = sum(programs().values())
    assert runner.warmup(2, 32) == len(todo) + 1  # and the page copy
    handed = sum(programs().values()) - before  # compiled here, or loaded from the disk cache
    assert len(threads) == len(todo) and all(t.startswith("compile") for t in threads)
    # each step program once (its first run reuses it), the page copy, at most one more small
    # program; compiled again at the first runs it would be 2 * len(todo)
    assert len(todo) >= 3 and len(todo) + 1 <= handed <= len(todo) + 2


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_a_bad_thread_count_is_refused_by_name(monkeypatch, bad):
    monkeypatch.setenv(COMPILE_THREADS_ENV, bad)
    with pytest.raises(ValueError, match=COMPILE_THREADS_ENV):
        compile_threads()
