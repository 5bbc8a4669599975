"""Helpers for the server tests (no tests here): a real `pagedserve serve` subprocess on a
free port, SSE parsing and /metrics reading."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator

import httpx

# One OpenMP thread per process: on a small, shared machine the test server, the CLI run and
# the test client compete for the same cores, and spinning OpenMP threads slow every step
# down several-fold. fp32 keeps greedy outputs comparable across processes.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "512", "--max-num-batched-tokens", "512"]
# Where the server runs its engine loop: a fixture's param, as a serve flag.
LOOP_FLAGS = {"thread": "--no-frontend-multiprocessing", "process": "--frontend-multiprocessing"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`pagedserve serve` in a subprocess; ``url`` once ``wait_ready()`` returned."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(self.port),
               "--log-level", "warning", *ENGINE_ARGS, *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=ENV)

    def wait_ready(self, timeout: float = 240.0) -> RemoteServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.output()}")

    def __enter__(self) -> RemoteServer:
        """Ready, or stopped (a server that never got ready is not left running)."""
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def child_pids(server_pid: int) -> list[int]:
    """A server's child processes (its engine process; with --api-server-count, its servers
    too), less multiprocessing's resource tracker."""
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        children = [int(pid) for pid in f.read().split()]
    pids = []
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():
                pids.append(pid)
    return pids


def sigterm_mid_stream(server: RemoteServer, prompt: str) -> int:
    """SIGTERM the server while a stream runs: graceful, the stream runs to its end; the
    server's exit status."""
    body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert "choices" in next(sse_events(lines))
        server.proc.send_signal(signal.SIGTERM)
        rest = list(sse_events(lines))
    assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length"
    return server.proc.wait(60)


def assert_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


def tcp_sockets(pid: int, port: int, state: str) -> int:
    """How many TCP sockets of process ``pid`` have local ``port`` in ``state`` (as
    /proc/net/tcp writes it: "0A" listening, "01" established)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                if local_port == port and fields[3] == state and fields[9] in inodes:
                    count += 1
    return count


def run_generate(*args: str) -> subprocess.Popen:
    """`pagedserve generate` in the background; read with ``generate_outputs``."""
    cmd = [sys.executable, "-m", "pagedserve.cli", "generate", "--json", *ENGINE_ARGS, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV)


def generate_outputs(proc: subprocess.Popen) -> list[dict]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    return [o for o in map(json.loads, out.splitlines()) if "outputs" in o]


def sse_events(lines: Iterable[str]) -> Iterator[dict | str]:
    """Parsed `data:` payloads of an SSE stream; "[DONE]" comes through as the string."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        yield data if data == "[DONE]" else json.loads(data)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def metrics(url: str) -> dict[str, float]:
    """/metrics samples as {'name{labels}': value} plus {'name': sum over label sets}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        samples[name + labels] = value
        if labels:
            samples[name] = samples.get(name, 0.0) + value
    return samples


def wait_kv_free(url: str, timeout: float = 20.0) -> float:
    """Poll until the KV-blocks-used gauge reads 0; returns the last value read."""
    deadline = time.monotonic() + timeout
    used = -1.0
    while time.monotonic() < deadline:
        used = metrics(url).get("pagedserve_kv_blocks_used", -1.0)
        if used == 0:
            return used
        time.sleep(0.2)
    return used


# ---- reliability-suite helpers (tests/test_reliability_*.py) ------------------------------------
def tiny_server(model_dir, *args: str) -> RemoteServer:
    """A started server on the tiny random-weight Llama of conftest's ``tiny_llama_dir``: cheap
    generation, a short context (256) and at most 4 samples per request unless ``args`` say
    otherwise (argparse keeps the last value of a repeated flag)."""
    return RemoteServer("--model", str(model_dir), "--max-model-len", "256", "--max-n", "4",
                        *args).wait_ready()


def openai_error(r: httpx.Response, status: int) -> dict:
    """The ``error`` object of ``r``, after checking the status and OpenAI's error shape."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    return err


def rss_mb(pid: int) -> float:
    """Resident memory (VmRSS) of process ``pid`` in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def assert_alive_and_idle(url: str) -> None:
    """The engine answers /health 200 and, with nothing running, holds no KV block."""
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 200, r.text
    assert wait_kv_free(url) == 0
