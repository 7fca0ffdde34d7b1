"""Real `hybridserve serve` processes on loopback, and helpers to read them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Small settings keep compilation short; float32 keeps greedy parity with offline runs exact.
SMALL = ["--max-model-len", "256", "--max-num-seqs", "8", "--dtype", "float32"]
OFFLINE = dict(max_model_len=256, max_num_seqs=8, dtype="float32")
HEADER_TIMEOUT_S = 2.0  # --header-timeout of the shared server (conftest.py)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class ServerProcess:
    """`python -m hybridserve.cli serve --port 0 ARGS`, its log in `log_dir/NAME.log`."""

    def __init__(
        self, args: list[str], log_dir: Path, name: str = "server", env: dict | None = None
    ) -> None:
        self.args = args
        self.log_path = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.env = env  # the process's environment (default: this one's)

    def launch(self) -> ServerProcess:
        """Start the process (see `wait_ready`)."""
        env = {**(os.environ if self.env is None else self.env), "JAX_PLATFORMS": "cpu"}
        command = [sys.executable, "-m", "hybridserve.cli", "serve", "--port", "0", *self.args]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def start(self, timeout: float = 300.0) -> ServerProcess:
        return self.launch().wait_ready(timeout)

    def wait_ready(self, timeout: float = 300.0) -> ServerProcess:
        """Wait for the bound address in the log, then for /health to answer 200."""
        end = time.monotonic() + timeout
        while not self.url:
            if self.proc.poll() is not None or time.monotonic() > end:
                self.kill()
                raise RuntimeError(f"the server did not start:\n{self.log()}")
            found = re.search(r"listening on (http://[\d.]+:\d+)", self.log())
            self.url = found.group(1) if found else ""
            time.sleep(0.1)
        if not wait_until(self._healthy, end - time.monotonic(), 0.1):
            self.kill()
            raise RuntimeError(f"the server never became healthy:\n{self.log()}")
        return self

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def stats(self) -> dict:
        return httpx.get(self.url + "/v1/stats", timeout=10).json()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Samples of /metrics: (name, sorted label items but model_name) -> value."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {
            (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): (
                s.value
            )
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def idle(self, timeout: float = 30.0) -> bool:
        """Wait until no request runs or waits and every cache page is back in the pool."""

        def done() -> bool:
            s = self.stats()
            return (
                s["num_pages_used"] == 0
                and s["num_running"] == 0
                and s["num_waiting"] == 0
                and s["queue_depth"] == 0
                and s.get("held_requests", 0) == 0
            )

        return wait_until(done, timeout)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then wait; SIGKILL when it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ProxyProcess(ServerProcess):
    """`python -m hybridserve.cli proxy --port 0 ARGS`."""

    def launch(self) -> ProxyProcess:
        command = [sys.executable, "-m", "hybridserve.cli", "proxy", "--port", "0", *self.args]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)
            )
        return self


def counter(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
