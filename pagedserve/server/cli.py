"""`pagedserve serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import threading

from pagedserve.engine import InvalidRequest, LLMEngine
from pagedserve.engine.args import add_engine_args, engine_config
from pagedserve.engine.device_setup import resolve_device
from pagedserve.server.config import ServerConfig

FATAL_EXIT_DELAY_S = 2.0


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    add_engine_args(p)  # includes --model and --max-model-len
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use (default: the model's own name)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the /v1 routes")
    p.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help="refuse new requests (429) while N requests are unfinished")
    d = ServerConfig()
    p.add_argument("--max-n", type=int, default=d.max_n, metavar="N",
                   help="the most samples (n) one request may ask for (400 beyond)")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes, metavar="B",
                   help="refuse larger request bodies (413)")
    p.add_argument("--timeout-read", type=float, default=d.request_read_timeout, metavar="S",
                   help="a client must send a request's headers, and then its body, within "
                        "S seconds each, or its connection is closed (408 for a body)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="S",
                   help="close a keep-alive connection idle for S seconds")
    p.add_argument("--max-connections", type=int, default=4096, metavar="N",
                   help="answer 503 and close new connections past N open ones")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, how long in-flight requests may take to finish")
    p.add_argument("--frontend-multiprocessing", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="run the engine loop in a process of its own, beside the HTTP "
                        "server's, so that they share no GIL (default: on CUDA, where the "
                        "host's time per token is what bounds a stream; off on CPU); "
                        "--no-frontend-multiprocessing is vLLM's "
                        "--disable-frontend-multiprocessing")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    # In-function on purpose: uvicorn and the app (FastAPI) only load for `serve`, not for
    # every CLI start-up.
    import uvicorn

    from pagedserve.server.app import build_app
    from pagedserve.server.limits import guarded_http, raise_open_file_limit

    config = engine_config(args)
    for name in ("max_queue", "max_n", "max_request_bytes", "max_connections"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidRequest(f"--{name.replace('_', '-')} must be at least 1")
    if args.timeout_read <= 0 or args.timeout_keep_alive <= 0:
        raise InvalidRequest("--timeout-read and --timeout-keep-alive must be positive")
    if not 0 < args.port < 65536:
        raise InvalidRequest("--port must be in 1..65535")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    engine_process = args.frontend_multiprocessing
    if engine_process is None:
        engine_process = resolve_device(config.device).type == "cuda"
    app = build_app(
        ServerConfig(served_model_names=args.served_model_name, api_key=args.api_key,
                     max_queue=args.max_queue, max_n=args.max_n,
                     max_request_bytes=args.max_request_bytes,
                     request_read_timeout=args.timeout_read, engine_process=engine_process),
        factory=functools.partial(LLMEngine, config),  # pickles into an engine process
    )
    open_files = raise_open_file_limit()
    server = uvicorn.Server(uvicorn.Config(
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
    engine = app.state.ctx.engine
    # A tensor-parallel rank lost: in-flight requests have failed; shut down and say so,
    # after a moment in which health checks see the 503.
    engine.on_fatal = lambda: threading.Timer(
        FATAL_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True)).start()
    server.run()
    return 0 if server.started and not engine.fatal else 1
