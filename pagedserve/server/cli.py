"""`pagedserve serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
from typing import Any

from pagedserve.engine import InvalidRequest, LLMEngine
from pagedserve.engine.args import add_engine_args, engine_config
from pagedserve.engine.device_setup import resolve_device
from pagedserve.models.chat_template import TEMPLATE_VARIABLES
from pagedserve.server.config import ServerConfig
from pagedserve.server.tools import PARSERS

# vLLM's flags for what pagedserve always does, taken so that a `vllm serve` command line
# runs, with nothing to set (no environment variable of the container stands for them).
VLLM_COMPAT_FLAGS = {
    "--trust-remote-code": "no model code is ever run from a model's files (each "
                           "architecture is pagedserve's own)",
    "--enable-auto-tool-choice": "tool_choice auto is always on",
}


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (or --model)")
    add_engine_args(p)  # includes --model and --max-model-len
    p.add_argument("--seed", type=int, default=None,
                   help="seed the random draws of requests that give no seed of their own, "
                        "so that a run can be repeated (vLLM's flag; default: unseeded)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use (default: the model's own name)")
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (any one of the keys given) on "
                        "/v1/*, /tokenize, /detokenize and /invocations; default: the "
                        "VLLM_API_KEY variable's key, as vLLM")
    p.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help="refuse new requests (429) while N requests are unfinished")
    d = ServerConfig()
    p.add_argument("--max-n", type=int, default=d.max_n, metavar="N",
                   help="the most samples (n) one request may ask for (400 beyond)")
    p.add_argument("--max-prompts", type=int, default=d.max_prompts, metavar="N",
                   help="the most prompts one /v1/completions request may carry (400 beyond)")
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
    p.add_argument("--api-server-count", type=int, default=1, metavar="N",
                   help="N HTTP server processes on one port, each with its own pipes to one "
                        "engine process (vLLM's flag): requests are taken in and tokens "
                        "streamed out N at a time (needs the engine in a process of its "
                        "own); each takes its share of --max-connections")
    p.add_argument("--allowed-origins", type=_string_list, default=d.allowed_origins,
                   metavar="JSON", help='CORS: the origins whose pages may call the API, a '
                   'JSON list (default: ["*"], any; vLLM\'s flags, as the three below)')
    p.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction,
                   default=d.allow_credentials, help="CORS: allow cookies and HTTP auth")
    p.add_argument("--allowed-methods", type=_string_list, default=d.allowed_methods,
                   metavar="JSON", help="CORS: the methods allowed, a JSON list")
    p.add_argument("--allowed-headers", type=_string_list, default=d.allowed_headers,
                   metavar="JSON", help="CORS: the request headers allowed, a JSON list")
    for flag, why in VLLM_COMPAT_FLAGS.items():
        p.add_argument(flag, action="store_true", help=f"accepted for vLLM's command lines: {why}")
    p.add_argument("--default-chat-template-kwargs", type=_json_object, default=None,
                   metavar="JSON", help="the chat template's variables for every request, "
                   "under each request's own chat_template_kwargs (vLLM's flag; e.g. "
                   "'{\"enable_thinking\": false}' for a thinking model)")
    p.add_argument("--tool-call-parser", choices=PARSERS, default=d.tool_call_parser,
                   help="how tool_choice auto reads calls from the text (vLLM's names): "
                        "hermes, <tool_call> tags (Hermes, Qwen2.5/3); llama3_json, an output "
                        "of JSON {\"name\", \"parameters\"} objects (Llama 3.1+)")
    p.add_argument("--exclude-tools-when-tool-choice-none",
                   action=argparse.BooleanOptionalAction,
                   default=d.exclude_tools_when_tool_choice_none,
                   help="tool_choice none: the prompt shows no tools (by default a template "
                        "that reads them still gets them, as vLLM's)")
    p.add_argument("--trust-request-chat-template", action=argparse.BooleanOptionalAction,
                   default=d.trust_request_chat_template,
                   help="render a chat with the request's own chat_template (vLLM's flag; "
                        "by default such a request is a 400: a template is code that runs "
                        "on the server's time)")
    p.add_argument("--enable-request-id-headers", action=argparse.BooleanOptionalAction,
                   default=d.enable_request_id_headers,
                   help="every response carries X-Request-Id: the client's own, or a new one "
                        "(vLLM's flag)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def _string_list(value: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form: '["https://a.example"]')."""
    try:
        found = json.loads(value)
    except ValueError:
        found = None
    if not isinstance(found, list) or not all(isinstance(v, str) for v in found):
        raise argparse.ArgumentTypeError(f"a JSON list of strings is needed, not {value!r}")
    return found


def _json_object(value: str) -> dict[str, Any]:
    """A flag's JSON object; the names a template gets from the request itself refused."""
    try:
        found = json.loads(value)
    except ValueError:
        found = None
    if not isinstance(found, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, not {value!r}")
    if taken := TEMPLATE_VARIABLES & set(found):
        raise argparse.ArgumentTypeError(f"may not set {sorted(taken)}")
    return found


def cmd_serve(args: argparse.Namespace) -> int:
    # In-function on purpose: the server's modules only load for `serve`, not for every CLI
    # start-up.
    from pagedserve.server.launch import run_server, serve_many, server_config

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise InvalidRequest(f"two models given: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    config = dataclasses.replace(engine_config(args), seed=args.seed)
    for name in ("max_queue", "max_n", "max_prompts", "max_request_bytes", "max_connections",
                 "api_server_count"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidRequest(f"--{name.replace('_', '-')} must be at least 1")
    if args.timeout_read <= 0 or args.timeout_keep_alive <= 0:
        raise InvalidRequest("--timeout-read and --timeout-keep-alive must be positive")
    if args.api_key is not None and not all(args.api_key):
        raise InvalidRequest("--api-key must not be empty")
    if not 0 < args.port < 65536:
        raise InvalidRequest("--port must be in 1..65535")
    if args.api_server_count > 1 and args.frontend_multiprocessing is False:
        raise InvalidRequest("--api-server-count above 1 needs the engine loop in a process "
                             "of its own (drop --no-frontend-multiprocessing)")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    factory = functools.partial(LLMEngine, config)  # pickles into an engine process
    if args.api_server_count > 1:
        return serve_many(args, factory)
    engine_process = args.frontend_multiprocessing
    if engine_process is None:
        engine_process = resolve_device(config.device).type == "cuda"
    return run_server(args, server_config(args, engine_process), factory)
