"""The server's own settings (the engine's are EngineConfig); light to import, so that the
CLI can read the defaults without loading FastAPI."""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServerConfig:
    served_model_names: list[str] | None = None
    api_keys: list[str] | None = None  # a request must bear one of them (none: no key)
    max_queue: int | None = None  # refuse (429) beyond this many unfinished requests
    max_n: int = 128  # the most samples (n) one request may ask for
    # The most prompts one /v1/completions request may carry: each is an engine request, and
    # an 8 MiB body holds 1.5 million one-token prompts (gigabytes of queued requests).
    max_prompts: int = 1024
    tool_call_parser: str = "hermes"  # how tool_choice auto reads calls (server/tools.py)
    # The chat template's variables for every request, under its own (vLLM's flag)
    default_chat_template_kwargs: dict[str, Any] | None = None
    exclude_tools_when_tool_choice_none: bool = False  # (vLLM's flag)
    trust_request_chat_template: bool = False  # a request's own chat_template is used (vLLM's)
    enable_request_id_headers: bool = False  # X-Request-Id on every response (vLLM's flag)
    max_request_bytes: int = 8 << 20  # larger bodies are refused (413) unread
    request_read_timeout: float = 15.0  # seconds for a request body to arrive (else 408)
    # CORS, as vLLM sets it: any origin's page may call the API (without cookies or HTTP
    # auth; a bearer key is still needed where --api-key is set)
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    engine_process: bool = False  # the engine loop in a process of its own (else a thread)
    # --api-server-count: this server's index and its pipes (commands, events) to the engine
    # process its parent started
    server_index: int | None = None
    engine_pipes: tuple[Any, Any] | None = None
    shared_queue: Any | None = None  # the servers' one --max-queue count (queue_limit.py)
