"""`pagedserve serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
import signal

from pagedserve.engine import InvalidRequest, LLMEngine
from pagedserve.engine.args import add_engine_args, engine_config


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
    p.add_argument("--timeout-graceful-shutdown", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, how long in-flight requests may take to finish")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    # In-function on purpose: uvicorn and the app (FastAPI) only load for `serve`, not for
    # every CLI start-up.
    import uvicorn

    from pagedserve.server.app import ServerConfig, build_app

    config = engine_config(args)
    if args.max_queue is not None and args.max_queue < 1:
        raise InvalidRequest("--max-queue must be at least 1")
    if not 0 < args.port < 65536:
        raise InvalidRequest("--port must be in 1..65535")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    app = build_app(
        ServerConfig(served_model_names=args.served_model_name, api_key=args.api_key,
                     max_queue=args.max_queue),
        factory=lambda: LLMEngine(config),
    )
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
    ))
    # uvicorn re-raises the signal it shut down on; a SIGTERM that only ends the server
    # gracefully must leave exit status 0, so the handler it restores does nothing.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    return 0 if server.started else 1
