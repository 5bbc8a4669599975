"""Tensor-parallel ranks in real processes: `pagedserve serve -tp 2` losing its worker
mid-stream (the stream ends in an OpenAI-shaped 500 error, /health says 503, the server
exits non-zero), or while idle (the engine is dead at once); workers that outlive the thread
that built the engine and ignore SIGINT and SIGTERM (rank 0 drains, then stops them); a hung
worker failing the step after the collectives' timeout (whether it hangs waiting for a step
or before asking for the next one) and the start-up after the same timeout; a worker that
dies before the rendezvous failing the start at once; and two "nodes" started by two
torchrun invocations on localhost (env:// rendezvous), whose output equals TP=1's."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
from engine_utils import greedy, make_engine, run
from test_server_utils import ENV, RemoteServer, free_port, sse_events
from tp_utils import tiny_llama

from pagedserve.engine import distributed
from pagedserve.engine.distributed import RankFailed
from pagedserve.engine.model_runner import HEADER_LEN, STEP
from pagedserve.models.loader import load_model_files
from pagedserve.server.engine_loop import EngineLoop, ThreadInbox
from pagedserve.server.engine_messages import Died, Loaded, Stop

SPEC = distributed.WorkerSpec(model=None, dtype="float32", device="cpu", block_size=16,
                              native_kernels=False, triton_attention="auto", num_threads=1,
                              timeout_s=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("kv2"), heads=4, kv_heads=2, vocab=1000,
                      tied=False)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def test_worker_killed_mid_stream(model_dir):
    server = RemoteServer("--model", str(model_dir), "-tp", "2")
    try:
        server.wait_ready()
        [worker] = children(server.proc.pid)
        body = {"prompt": "t5 t6 t7", "max_tokens": 500, "temperature": 0, "ignore_eos": True,
                "stream": True}
        events = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for event in sse_events(r.iter_lines()):
                events.append(event)
                if len(events) == 3:
                    os.kill(worker, signal.SIGKILL)
        tokens, error, done = events[:-2], events[-2], events[-1]
        assert all("choices" in e for e in tokens) and done == "[DONE]"
        assert 3 <= len(tokens) < 500
        assert error["error"]["code"] == "engine_dead", error  # OpenAI's error shape
        assert "tensor-parallel rank failed" in error["error"]["message"]
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert server.proc.wait(30) != 0
        assert "rank 1 (pid" in server.output() and "SIGKILL" in server.output()
    finally:
        server.stop()


def test_hung_worker_times_out(model_dir):
    """Built in a thread that then exits (the worker's lifeline is rank 0's process, not that
    thread), and sent SIGINT and SIGTERM (a Ctrl-C, or a process group's SIGTERM: rank 0
    drains, then stops it), the worker still runs steps; stopped, it fails the next one."""
    loaded = load_model_files(str(model_dir), torch.float32)
    built = []
    builder = threading.Thread(target=lambda: built.append(make_engine(
        loaded, model=str(model_dir), tensor_parallel_size=2, num_threads=1,
        distributed_timeout_s=3)))
    builder.start()
    builder.join()
    [engine] = built
    [worker] = engine.group.workers
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(worker.pid, sig)
        time.sleep(0.5)
        assert worker.poll() is None
        [out] = run(engine, [[5, 6, 7]], greedy(4))
        assert len(out.outputs[0].token_ids) == 4
        os.kill(worker.pid, signal.SIGSTOP)
        engine.add_request([5, 6, 7], greedy(4))
        start = time.monotonic()
        with pytest.raises(RankFailed, match="(?i)timed out"):
            engine.step()
        assert time.monotonic() - start < 30
    finally:
        engine.close()  # kills the stopped worker
    assert worker.wait(10) == -signal.SIGKILL
    assert not torch.distributed.is_initialized()  # a new engine may start its own ranks


@pytest.mark.timeout(60)  # what it checks is that nothing waits for good
@pytest.mark.parametrize("stage", ["start-up", "step"])
def test_rank_that_never_answers_times_out(stage):
    """A gloo send completes only once the receiver has posted its receive, so rank 0's
    header waits on a rank stuck before its next receive: it must fail after the step
    timeout, not wait for good (a worker stopped right after start-up did, in CI). So must
    a start-up message (here, the KV pool's size) to a rank that stalled after joining."""
    init = f"tcp://127.0.0.1:{free_port()}"
    stuck = subprocess.Popen([sys.executable, "-c", "import time; from pagedserve.engine "
                              f"import distributed as d; d._join(1, 2, {init!r}, 0); "
                              "time.sleep(120)"], env=ENV)
    group = distributed._join(0, 2, init, 0, SPEC, [stuck])[0]
    try:
        start = time.monotonic()
        if stage == "step":
            with pytest.raises(RankFailed, match="timed out"), group.fatal_errors():
                group.send([STEP] + [0] * (HEADER_LEN - 1), torch.zeros(0, dtype=torch.int64))
        else:
            with pytest.raises(RankFailed, match="rank 1 did not answer within 3 s"):
                group.share_ints([64, 2048], 2)
        assert 3 <= time.monotonic() - start < 30
    finally:
        group.close()  # kills the stuck rank
    assert stuck.wait(10) == -signal.SIGKILL
    assert not torch.distributed.is_initialized()


def test_worker_dead_before_the_rendezvous_fails_the_start_at_once(monkeypatch):
    """Not after the rendezvous' timeout, and with the rank and how it ended."""
    real_popen = subprocess.Popen

    def dying_worker(args, **kwargs):
        kill = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
        return real_popen([sys.executable, "-c", kill], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", dying_worker)
    monkeypatch.setattr(distributed, "START_TIMEOUT", timedelta(seconds=20))
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+\) exited with SIGKILL"):
        distributed.start(2, SPEC)
    assert time.monotonic() - start < 10
    assert not torch.distributed.is_initialized()


def test_rank_exit_while_idle_kills_the_engine_at_once(model_dir):
    """A worker that exits while nothing runs: the engine loop says Died (fatal: /health
    503, the server exits) at once, not when the next request fails on it."""
    loaded = load_model_files(str(model_dir), torch.float32)
    engine = make_engine(loaded, model=str(model_dir), tensor_parallel_size=2, num_threads=1)
    [worker] = engine.group.workers
    events: queue.SimpleQueue = queue.SimpleQueue()
    inbox = ThreadInbox()
    loop = threading.Thread(target=EngineLoop(lambda: engine, inbox,
                                              lambda batch: [events.put(e) for e in batch]).run)
    loop.start()
    try:
        while not isinstance(events.get(timeout=30), Loaded):
            pass
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not isinstance(event := events.get(timeout=max(0, deadline - time.monotonic())),
                             Died):
            pass
        assert event.fatal and "tensor-parallel rank" in event.error
    finally:
        inbox.put(Stop())
        loop.join(30)
        engine.close()
    assert not torch.distributed.is_initialized()


def torchrun(node_rank: int, port: int, *args: str) -> subprocess.Popen:
    """One "node" of two, with one rank: torchrun's static env:// rendezvous on localhost."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
           str(node_rank), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "--module", "pagedserve.cli", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV)


def test_two_nodes_with_torchrun(model_dir):
    prompt = "t11 t12 t13 t14 t15 t16 t17"
    args = ["generate", "-tp", "2", "--model", str(model_dir), "--dtype", "float32",
            "--num-kv-blocks", "64", "--max-tokens", "8", "--ignore-eos", "--json", prompt]
    port = free_port()
    nodes = [torchrun(rank, port, *args) for rank in (0, 1)]
    results = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, results, strict=True):
        assert node.returncode == 0, err[-3000:]
    [out] = [json.loads(line) for line in results[0][0].splitlines() if '"outputs"' in line]
    assert results[1][0] == ""  # rank 1 only computes

    loaded = load_model_files(str(model_dir), torch.float32)
    [single] = run(make_engine(loaded), [loaded.tokenizer.encode(prompt)], greedy(8))
    assert out["outputs"][0]["token_ids"] == single.outputs[0].token_ids
