"""Chat templates rendered as transformers renders them: the same sandboxed Jinja
environment (its `tojson`, `raise_exception`, `strftime_now`, loop controls and the
`{% generation %}` tag), the same variables, `continue_final_message` cut where the final
message ends, and for templates that know no tools, the tools written into the messages."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# What a rendering sets itself; a caller's extra variables may not.
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token",
                                "tools", "continue_final_message"})
# Put after the final message's text when it is to be continued, and cut at: unlike a search
# for the text itself, it finds an empty message, and not its text inside a closing token.
_CONTINUE_MARK = "<|pagedserve-continue-here|>"


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (SmolLM3's template): transformers marks the
    assistant's tokens with it, for training masks; rendered here as its body alone."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# The most items (characters) one `*` may make, and bits one `**` may: a template, a
# request's own under --trust-request-chat-template, made a string of 10**10 characters in
# one expression and the kernel killed the server for its memory. Chat templates repeat a
# few characters (an indent, a rule of "-").
MAX_REPEATED, MAX_POWER_BITS = 1 << 20, 1 << 12
# A rendering with no caller's limit (a prompt to be cut to its last tokens, the offline
# chat) stops here: a loop of such repetitions would otherwise fill the memory all the same.
MAX_RENDERED_CHARS = 1 << 26


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox with `*` and `**` bounded (MAX_REPEATED, MAX_POWER_BITS)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for items, times in ((left, right), (right, left)):
                if (isinstance(items, str | list | tuple) and isinstance(times, int)
                        and len(items) * times > MAX_REPEATED):
                    raise SecurityError(f"a repetition of more than {MAX_REPEATED} items")
        elif (isinstance(left, int) and isinstance(right, int) and right > 0
              and right * (abs(left).bit_length() - 1) > MAX_POWER_BITS):
            raise SecurityError(f"a power of more than {MAX_POWER_BITS} bits")
        return super().call_binop(context, operator, left, right)


class ChatTemplate:
    """One template's source, compiled once (ValueError if it does not compile)."""

    def __init__(self, source: str):
        env = _BoundedSandbox(
            trim_blocks=True, lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _GenerationTag])
        env.globals.pop("lipsum", None)  # (paragraphs of filler text, as many as asked)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            variables = jinja2.meta.find_undeclared_variables(env.parse(source))
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"invalid chat template: {e}") from e
        self.takes_tools = "tools" in variables

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               bos_token: str, eos_token: str, tools: list[dict[str, Any]] | None = None,
               continue_final_message: bool = False, extra: dict[str, Any] | None = None,
               max_chars: int | None = None) -> str:
        """`tools` (OpenAI's tool definitions) go to the template's `tools` variable, or into
        the messages when it reads none; `extra` are the template's own variables (not those
        named in TEMPLATE_VARIABLES: ValueError). `continue_final_message` (HF's and vLLM's):
        the rendering ends right after the final message's text, which the model continues.
        Past `max_chars` the rendering stops, and what it made so far comes back (longer than
        that: the caller's refusal), so that a loop cannot fill the memory; with none, past
        MAX_RENDERED_CHARS it is the template's error."""
        extra = dict(extra or {})
        if taken := TEMPLATE_VARIABLES & set(extra):
            raise ValueError(f"chat template variables set by the server: {sorted(taken)}")
        messages = [_with_reasoning_content(m) for m in messages]
        if tools and not self.takes_tools:
            messages, tools = render_tools_in_messages(messages, tools), None
        if tools:
            extra["tools"] = tools
        if continue_final_message:
            final = messages[-1] if messages else {"content": None}
            if not messages or not isinstance(final.get("content") or "", str):
                raise ValueError("continue_final_message: the final message must be text")
            messages[-1] = {**final, "content": (final.get("content") or "") + _CONTINUE_MARK}
        pieces, length = [], 0
        try:
            for piece in self.template.generate({  # a dict: any variable name may be given
                    **extra, "messages": messages, "add_generation_prompt": add_generation_prompt,
                    "bos_token": bos_token, "eos_token": eos_token}):
                pieces.append(piece)
                length += len(piece)
                if max_chars is not None and length > max_chars:
                    return "".join(pieces)
                if length > MAX_RENDERED_CHARS:
                    raise ValueError(f"chat template error: the rendering passed "
                                     f"{MAX_RENDERED_CHARS} characters")
        except ValueError:  # raise_exception's, worded already
            raise
        except Exception as e:  # noqa: BLE001 - a template's error, or one a variable's value
            # caused (an int added to a string): the request's to fix, never a crash
            raise ValueError(f"chat template error: {str(e) or type(e).__name__}") from e
        text = "".join(pieces)
        if not continue_final_message:
            return text
        at = text.rfind(_CONTINUE_MARK)
        if at == -1:
            raise ValueError("continue_final_message: the template does not show the final "
                             "message's text")
        return text[:at]


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message in OpenAI's form as HF templates read it (vLLM's rendering, for the
    server and the offline chat alike): "developer" as "system", the content as one string
    (text parts, and an assistant's refusal parts, joined by newlines; none: ""), and each
    earlier call's arguments, a JSON string, as what it holds; no calls (``[]``) is no
    ``tool_calls`` (a template tests for the key), and ``reasoning`` is ``reasoning_content``
    (Qwen3's name). Other keys stay as given."""
    out = dict(message)
    out["role"] = {"developer": "system"}.get(out.get("role"), out.get("role"))
    out["content"] = content_text(out.get("content"))
    if "reasoning" in out:
        reasoning = out.pop("reasoning")
        out.setdefault("reasoning_content", reasoning)
    if not out.get("tool_calls"):
        out.pop("tool_calls", None)
    else:
        out["tool_calls"] = [
            {"id": c.get("id"), "type": "function", "function": {
                "name": c["function"]["name"],
                "arguments": call_arguments(c["function"].get("arguments", "{}"))}}
            for c in out["tool_calls"]]
    return out


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    """A message's content as one string: its text parts (and refusal parts) joined by
    newlines; none: ""."""
    return "\n".join(map(_part_text, content)) if isinstance(content, list) else content or ""


def _part_text(part: dict[str, Any]) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    check_part_type(kind)
    return part[kind]


def check_part_type(kind: Any) -> None:
    """ValueError for a content part other than text (or an assistant's refusal)."""
    if kind not in ("text", "refusal"):
        raise ValueError(f"content parts of type {kind!r} are not supported: text parts only "
                         "are read (and refusal parts)")


def call_arguments(text: Any) -> Any:
    """A call's arguments as JSON for the template, or the text as it is where it does not
    parse (nested past the decoder's recursion limit too); none ("" or null) are ``{}``,
    as vLLM renders them. Arguments given as an object already stay as they are."""
    if not isinstance(text, str):
        return {} if text is None else text
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return {} if value is None else value


def _with_reasoning_content(message: dict[str, Any]) -> dict[str, Any]:
    """As transformers does: a message's `reasoning` or `thinking` (other APIs' names) is
    its `reasoning_content` too, which Qwen3-style templates read."""
    if "reasoning_content" in message:
        return message
    alias = message.get("reasoning", message.get("thinking"))
    return message if alias is None else {**message, "reasoning_content": alias}


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF templates expect non-ASCII text kept as-is, not \u-escaped (jinja's own tojson escapes).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


# For templates that ignore `tools` (SmolLM2's): Hermes/Qwen-style tags, which the server's
# tool parser reads back (pagedserve/server/tools.py).
_TOOLS_PROMPT = """# Tools

You can call functions to help answer. Their signatures, one JSON object each, are inside
<tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and its arguments inside
<tool_call></tool_call> tags, one call per pair of tags:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>"""


def render_tools_in_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]
                             ) -> list[dict[str, Any]]:
    """Tool use spelled out in plain messages, for a template that knows neither `tools`
    nor tool calls: the tools go into the system prompt, an assistant's calls into
    <tool_call> tags and a tool's answer into <tool_response> tags."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    system = _TOOLS_PROMPT.format(tools=listing)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{system}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": system})
    for m in out:
        calls = m.pop("tool_calls", None) or []
        tags = [json.dumps({"name": c["function"]["name"],
                            "arguments": c["function"].get("arguments", {})},
                           ensure_ascii=False) for c in calls]
        if tags:
            text = "\n".join(f"<tool_call>\n{t}\n</tool_call>" for t in tags)
            m["content"] = f"{m.get('content') or ''}\n{text}".lstrip()
        if m.get("role") == "tool":
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        m.pop("tool_call_id", None)
        m["content"] = m.get("content") or ""
    return out
