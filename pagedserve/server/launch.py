"""Starting `pagedserve serve`: one uvicorn server (its engine loop in a thread or a process of
its own), or with ``--api-server-count N`` N server processes on one port, each with its
own listening socket and its own pipes to one engine process, started and stopped together
by this process (as vLLM runs its API servers). More servers take requests in, and stream
tokens out, N at a time: one event loop takes a burst of requests in one after another."""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from pagedserve.engine import InvalidRequest, LLMEngine
from pagedserve.engine.distributed import die_with_parent
from pagedserve.server.config import ServerConfig
from pagedserve.server.engine_process import engine_pipes, run_engine_process

log = logging.getLogger("pagedserve.server")
FATAL_EXIT_DELAY_S = 2.0
STREAM_END_MARGIN_S = 1.0  # before the graceful timeout: time to send the streams' ends
ENGINE_STOP_TIMEOUT_S = 30.0


def server_config(args: argparse.Namespace, engine_process: bool, **more: Any) -> ServerConfig:
    # As vLLM: without --api-key, the VLLM_API_KEY variable's key (a migrated deployment that
    # sets only it must not come up open).
    api_keys = args.api_key or [key for key in [os.environ.get("VLLM_API_KEY")] if key]
    return ServerConfig(served_model_names=args.served_model_name, api_keys=api_keys or None,
                        max_queue=args.max_queue, max_n=args.max_n,
                        max_prompts=args.max_prompts, tool_call_parser=args.tool_call_parser,
                        default_chat_template_kwargs=args.default_chat_template_kwargs,
                        exclude_tools_when_tool_choice_none=(
                            args.exclude_tools_when_tool_choice_none),
                        trust_request_chat_template=args.trust_request_chat_template,
                        enable_request_id_headers=args.enable_request_id_headers,
                        max_request_bytes=args.max_request_bytes,
                        request_read_timeout=args.timeout_read, engine_process=engine_process,
                        allowed_origins=args.allowed_origins,
                        allow_credentials=args.allow_credentials,
                        allowed_methods=args.allowed_methods,
                        allowed_headers=args.allowed_headers, **more)


def run_server(args: argparse.Namespace, config: ServerConfig,
               factory: Callable[[], LLMEngine] | None,
               sockets: list[socket.socket] | None = None) -> int:
    """Serve until shut down; the exit status (1 if it never started or the engine died for
    good)."""
    # In-function on purpose: uvicorn and the app (FastAPI) only load for `serve`.
    import uvicorn

    from pagedserve.server.app import build_app
    from pagedserve.server.limits import guarded_http, raise_open_file_limit

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # What still runs as the graceful timeout ends fails just before it: a stream
            # then ends in an error event and [DONE], where a cut alone would read, to a
            # client, as an output complete.
            timer = asyncio.get_running_loop().call_later(
                max(args.timeout_graceful_shutdown - STREAM_END_MARGIN_S, 0.0),
                engine.fail_in_flight, "The server shut down before this request finished.")
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    app = build_app(config, factory)
    engine = app.state.ctx.engine
    open_files = raise_open_file_limit()
    server = DrainingServer(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
        timeout_keep_alive=args.timeout_keep_alive,
        # Keep headroom under the open-file limit for the model, logs and the listener.
        http=guarded_http(args.timeout_read, min(args.max_connections, open_files - 64)),
        # Not uvloop where it is installed ("auto"): measured slower here a streamed token,
        # and the engine process's events pipe broke during loading in 2 of 5 starts on it.
        loop="asyncio",
    ))
    # uvicorn re-raises the signal it shut down on; a SIGTERM that only ends the server
    # gracefully must leave exit status 0, so the handler it restores does nothing.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    # The model failed to load, or a tensor-parallel rank was lost (in-flight requests have
    # failed): shut down and say so, after a moment in which health checks see the 503.
    engine.on_fatal = lambda: threading.Timer(
        FATAL_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True)).start()
    server.run(sockets=sockets)
    return 0 if server.started and not engine.fatal else 1


def serve_many(args: argparse.Namespace, factory: Callable[[], LLMEngine]) -> int:
    """``--api-server-count`` servers and their engine process; returns when all have ended:
    on SIGTERM or SIGINT (passed on to the servers once; each drains its streams, then
    closes its pipes, and the engine stops when the last is closed), or when a server exits
    unasked (the others are then stopped too, and the status is 1)."""
    # The servers share the port through SO_REUSEPORT, which would as gladly share it with
    # another instance already there: as with one server, a port in use is an error.
    try:
        listen(args, reuse_port=False).close()
    except OSError as e:
        raise InvalidRequest(f"cannot listen on {args.host}:{args.port}: {e}") from None
    metrics_dir = tempfile.mkdtemp(prefix="pagedserve-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the servers
    context = multiprocessing.get_context("spawn")  # a fork would copy threads and CUDA
    pipes = [engine_pipes(context) for _ in range(args.api_server_count)]
    engine = context.Process(
        target=run_engine_process, name="pagedserve-engine", daemon=True,
        args=(factory, [commands[0] for commands, _ in pipes],
              [events[1] for _, events in pipes], logging.getLogger().level, os.getpid()))
    shared_queue = context.Value("q", 0)  # every server's unfinished requests
    servers = [context.Process(target=_server_main, name=f"pagedserve-api-{index}",
                               args=(args, index, commands[1], events[0], shared_queue,
                                     os.getpid()))
               for index, (commands, events) in enumerate(pipes)]
    supervisor = Supervisor(engine, servers)
    try:
        engine.start()
        for server in servers:
            server.start()
        for commands, events in pipes:  # the children hold them now: their exits read as EOF
            for conn in (*commands, *events):
                conn.close()
        return supervisor.wait()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


class Supervisor:
    """Passes SIGTERM and SIGINT on to the servers, and stops them all if one exits unasked.
    A second signal forces them (as a second Ctrl-C does one uvicorn server)."""

    def __init__(self, engine: multiprocessing.process.BaseProcess,
                 servers: list[multiprocessing.process.BaseProcess]):
        self.engine, self.servers = engine, servers
        self.signals = 0
        signal.signal(signal.SIGTERM, self.stop)  # before the children start: no window
        signal.signal(signal.SIGINT, self.stop)

    def stop(self, *_: Any) -> None:
        self.signals += 1
        for server in self.servers:
            if server.pid is not None and server.exitcode is None:
                os.kill(server.pid, signal.SIGTERM if self.signals == 1 else signal.SIGINT)

    def wait(self) -> int:
        """The exit status: 1 if a server failed or exited unasked."""
        failed = False
        running = list(self.servers)
        while running:
            wait([server.sentinel for server in running])
            for server in [s for s in running if s.exitcode is not None]:
                running.remove(server)
                if server.exitcode != 0 or not self.signals:
                    log.error("%s exited (exit code %s); stopping the others", server.name,
                              server.exitcode)
                    failed = True
                    if not self.signals:
                        self.stop()
        # Each server's Stop (or its pipe's end) reaches the engine: it stops after the last,
        # once loaded. As with one server, one that takes too long is killed.
        self.engine.join(ENGINE_STOP_TIMEOUT_S)
        if self.engine.exitcode is None:
            self.engine.kill()
        return 1 if failed else 0


def _server_main(args: argparse.Namespace, index: int, commands: Any, events: Any,
                 shared_queue: Any, parent: int) -> None:
    # A group of its own: a terminal's Ctrl-C reaches the parent alone, which passes it on
    # (two signals at once would make uvicorn skip its graceful shutdown).
    os.setpgrp()
    die_with_parent(parent)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    # A listening socket of its own on the shared port (SO_REUSEPORT): the kernel spreads new
    # connections over the servers evenly. On one shared socket the first server awake takes
    # nearly all (30 of 32 connections, measured).
    listener = listen(args, reuse_port=True)
    args = share_limits(args)
    config = server_config(args, engine_process=True, server_index=index,
                           engine_pipes=(commands, events), shared_queue=shared_queue)
    sys.exit(run_server(args, config, factory=None, sockets=[listener]))


def listen(args: argparse.Namespace, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    return socket.create_server((args.host, args.port), family=family, backlog=2048,
                                reuse_port=reuse_port)


def share_limits(args: argparse.Namespace) -> argparse.Namespace:
    """One server's share of --max-connections (each counts its own connections): the total
    over the count, rounded up. (--max-queue needs no share: the servers count their
    unfinished requests in one shared count.)"""
    share = -(-args.max_connections // args.api_server_count)
    return argparse.Namespace(**{**vars(args), "max_connections": share})
