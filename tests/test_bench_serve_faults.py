"""`bench serve` against a server that misbehaves (a real HTTP server on loopback): each bad
response fails its own request, named in the report, and the run goes on; a client process
that dies ends the run with one line. The prompt of each request picks what the server
does with it."""

import asyncio
import json
import multiprocessing
import os
import signal
import threading

import pytest
from test_bench_serve import serving

from pagedserve.cli import main


def _chunk(text: str) -> str:
    return f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}\n\n"


USAGE = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
RAW = {  # streams of bad data: lines after one good chunk
    "null": "data: null\n\n",
    "notjson": "data: {oops\n\n",
    "nochoices": 'data: {"id": "x"}\n\n',
    "badchoices": 'data: {"choices": [null]}\n\n',
}


def misbehaving_app():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def generate(request):
        what = (await request.json())["prompt"]
        if what == "plain":  # a whole completion, not a stream
            return JSONResponse({"choices": [{"index": 0, "text": "ab"}], "usage": USAGE})

        async def events():
            if what == "kill":  # as the OOM killer would, to one client process
                os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)
            if what in ("kill", "hang"):
                await asyncio.sleep(30)  # cancelled when the client goes
            if what == "slow":  # each read well inside --timeout 1, the whole not
                for _ in range(20):
                    yield _chunk("a")
                    await asyncio.sleep(0.2)
            if what == "ok":
                yield _chunk("a") + _chunk("b")
            if what in RAW:
                yield _chunk("a") + RAW[what]
            if what in ("ok", "empty"):  # empty: usage and [DONE], no token
                usage = {**USAGE, "completion_tokens": 2 if what == "ok" else 0}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", generate, methods=["POST"])])


@pytest.fixture
def bad_server():
    with serving(misbehaving_app()) as url:
        yield url


def _dataset(tmp_path, prompts):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return data


def _serve(tmp_path, url, prompts, *args: str) -> tuple[int, dict]:
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", url, "--model", "m", "--dataset",
               str(_dataset(tmp_path, prompts)),
               "--num-prompts", str(len(prompts)), "--output-len", "2", "--json", str(out),
               *args])
    return rc, json.loads(out.read_text())


def test_a_response_without_a_token_chunk_fails(tmp_path, bad_server):
    """HTTP 200 is not enough (vLLM's rule): no SSE stream, or a stream that ends without a
    content chunk, leaves no TTFT to measure."""
    rc, r = _serve(tmp_path, bad_server, ["ok", "plain", "empty"])
    assert rc == 0
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (1, 2, 2)
    assert sorted(r["errors"]) == [
        "HTTP 200 but not an SSE stream (content-type: application/json)",
        "Never received a valid chunk to calculate TTFT"]


def test_a_malformed_chunk_fails_its_request_only(tmp_path, bad_server, capsys):
    rc, r = _serve(tmp_path, bad_server, ["ok", *RAW, "ok"])
    assert rc == 0
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (2, 4, 4)
    assert len(r["errors"]) == 4 and all("malformed stream chunk" in e for e in r["errors"])
    assert "Traceback" not in capsys.readouterr().err


def test_timeout_bounds_the_whole_request(tmp_path, bad_server):
    """A chunk every 0.2 s for 4 s: no read waits near --timeout 1, the request does."""
    rc, r = _serve(tmp_path, bad_server, ["slow"], "--timeout", "1")
    assert rc == 1
    assert (r["completed"], r["failed"]) == (0, 1)
    assert r["errors"] == ["timeout: no complete response in 1 s"]


def test_a_dead_client_process_ends_the_run_with_one_line(tmp_path, bad_server, capsys):
    """The first request kills a client process (SIGKILL); the others hang: the parent
    notices the death, stops the other process and exits 1, instead of waiting forever."""
    outcome: list[int] = []
    run = threading.Thread(target=lambda: outcome.append(main([
        "bench", "serve", "--base-url", bad_server, "--model", "m", "--dataset",
        str(_dataset(tmp_path, ["kill", "hang", "hang", "hang"])), "--num-prompts", "4",
        "--num-workers", "2"])), daemon=True)
    run.start()
    run.join(60)
    assert not run.is_alive(), "the run never ended"
    err = capsys.readouterr().err
    assert outcome == [1]
    last = err.splitlines()[-1]
    assert last.startswith("pagedserve: error: client process")
    assert last.endswith("was killed by SIGKILL before it reported its results")
    assert "Traceback" not in err
    assert multiprocessing.active_children() == []  # the other client process stopped too

