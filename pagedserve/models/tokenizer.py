"""Tokenizer: a `tokenizers.Tokenizer` plus the special-token and chat-template facts around it.

Built either from a Hugging Face directory (tokenizer.json and friends) or from the metadata of a
GGUF file, which carries the vocabulary and merges but no tokenizer.json.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from pagedserve.models.chat_template import ChatTemplate

# Split regexes llama.cpp names by `tokenizer.ggml.pre`; each matches the tokenizer.json of the
# model family it names.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# llama.cpp token types
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":
        # SmolLM/SmolLM2's tokenizer.json: every digit on its own, then GPT-2's byte-level regex.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("gpt-2", "gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = sorted(["smollm", "gpt-2", "default", *_SPLITS])
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(known)}")


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    """A config's token id or list of them (ValueError for anything else)."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"eos_token_id must be a token id or a list of them, not {value!r}")
    return values


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            found = json.load(f)
        except ValueError as e:  # say which of the directory's files it is
            raise ValueError(f"{os.path.basename(path)}: {e}") from e
    if not isinstance(found, dict):
        raise ValueError(f"{os.path.basename(path)}: a JSON object is needed")
    return found


class PromptTooLong(ValueError):
    """A rendered prompt with more characters than the caller allowed."""

    def __init__(self, num_chars: int):
        super().__init__(f"the prompt has {num_chars} characters")
        self.num_chars = num_chars


def check_text(text: str) -> None:
    """ValueError for a text with no UTF-8 bytes: a lone surrogate (JSON's "\\ud800", argv
    bytes that are not UTF-8), which the backend refuses with a TypeError that names nothing."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("the text is not valid UTF-8 (it holds a lone surrogate)") from None


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE piece uses for
    each raw byte (printable bytes stand for themselves, the rest are shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable},
            **{chr(256 + i): b for i, b in enumerate(shifted)}}


class Tokenizer:
    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        add_bos: bool,
        add_eos: bool = False,
        chat_template: str | None = None,
        tool_use_template: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.chat_template = chat_template
        # A model's named "tool_use" template, which transformers picks when tools are given.
        self.tool_use_template = tool_use_template
        self.vocab_size: int = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        self._template: ChatTemplate | None = None
        self._tool_use: ChatTemplate | None = None

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_file):
            raise FileNotFoundError(f"{path}: no tokenizer.json")
        try:
            backend = _Backend.from_file(tok_file)
        except Exception as e:  # noqa: BLE001 - tokenizers raises its errors as Exception
            raise ValueError(f"tokenizer.json: {e}") from None
        tcfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))
        mcfg = _read_json(os.path.join(path, "config.json"))

        def token_id(name: str) -> int | None:
            content = _token_content(tcfg.get(name))
            return backend.token_to_id(content) if content is not None else None

        bos = token_id("bos_token")  # None when the config names none (Qwen), as in transformers
        eos = [i for i in [token_id("eos_token")] if i is not None]
        eos += _ids(gen.get("eos_token_id")) + _ids(mcfg.get("eos_token_id"))
        if "add_bos_token" in tcfg:
            add_bos = bool(tcfg["add_bos_token"]) and bos is not None
        else:
            # No flag: the tokenizer.json post-processor decides, as it does in transformers.
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and probe[:1] == [bos]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos,
            add_bos=add_bos,
            add_eos=bool(tcfg.get("add_eos_token", False)),
            **cls._hf_chat_templates(path, tcfg),
        )

    @staticmethod
    def _hf_chat_templates(path: str, tcfg: dict[str, Any]) -> dict[str, str | None]:
        """chat_template and tool_use_template. Precedence as in transformers: the .jinja file,
        then chat_template.json, then the config."""
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                return {"chat_template": f.read()}
        template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
        template = template or tcfg.get("chat_template")
        if template is None or isinstance(template, str):
            return {"chat_template": template}
        if not isinstance(template, list) or not all(
                isinstance(t, dict) and isinstance(t.get("template"), str) for t in template):
            raise ValueError("chat_template must be a string, or a list of {name, template}")
        named = {t.get("name"): t["template"] for t in template}  # [{"name", "template"}]
        return {"chat_template": named.get("default") or next(iter(named.values()), None),
                "tool_use_template": named.get("tool_use")}

    @classmethod
    def from_gguf(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """From a GGUF file's `tokenizer.*` metadata (byte-level BPE vocabularies only)."""
        get = fields.get
        kind = get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') works"
            )
        tokens: list[str] = get("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]
        types: Sequence[int] = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        pre = get("tokenizer.ggml.pre", "default")
        # Llama 3's tokenizer.json takes a whole pre-token from the vocab before merging.
        ignore_merges = pre in ("llama-bpe", "llama3", "llama-v3")
        backend = _Backend(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
        backend.pre_tokenizer = _pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        # Control tokens are matched whole and dropped by skip_special_tokens; user-defined ones
        # (like <think>) are matched whole too but kept in decoded text, as llama.cpp does.
        added = [
            AddedToken(tokens[i], special=t == _CONTROL, normalized=False)
            for i, t in enumerate(types)
            if t in (_CONTROL, _USER_DEFINED)
        ]
        backend.add_special_tokens([a for a in added if a.special])
        backend.add_tokens([a for a in added if not a.special])

        bos = get("tokenizer.ggml.bos_token_id")
        eos = [get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=[int(e) for e in eos if e is not None],
            add_bos=bool(get("tokenizer.ggml.add_bos_token", False)) and bos is not None,
            add_eos=bool(get("tokenizer.ggml.add_eos_token", False)),
            chat_template=get("tokenizer.chat_template"),
            tool_use_template=get("tokenizer.chat_template.tool_use"),
            vocab_size=len(tokens),
        )

    # -- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_text(text)
        # The backend never adds specials itself: BOS/EOS are our call, whatever the post-processor.
        # The batch call releases the GIL while it works (encode() holds it: seconds for a
        # long text, during which a server's event loop would stall).
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        head, tail = self._special_ends(add_special_tokens)
        return [*head, *ids, *tail] if head or tail else ids

    def _special_ends(self, add_special_tokens: bool) -> tuple[list[int], list[int]]:
        """The ids encode() puts before and after a text's own."""
        if not add_special_tokens:
            return [], []
        head = [self.bos_token_id] if self.add_bos and self.bos_token_id is not None else []
        tail = [self.eos_token_ids[0]] if self.add_eos and self.eos_token_ids else []
        return head, tail

    def keep_last(self, ids: list[int], max_length: int, add_special_tokens: bool = True
                  ) -> list[int]:
        """encode()'s ``ids`` cut to ``max_length`` by dropping the text's first tokens; the
        BOS and EOS encode() added stay. This is transformers' truncation on the left, which
        vLLM's truncate_prompt_tokens applies to a text prompt."""
        if len(ids) <= max_length:
            return ids
        head, tail = self._special_ends(add_special_tokens)
        body = ids[len(head) : len(ids) - len(tail)]
        kept = max(0, max_length - len(head) - len(tail))
        return [*head, *body[len(body) - kept :], *tail]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most characters any one token decodes to (at most its vocabulary string's
        length), so that a text of n characters has at least n / this many tokens."""
        return max(1, max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1))

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids that decoding with skip_special_tokens drops."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items()
                         if t.special)

    def token_text(self, id: int) -> str:
        """The token's text where it stands in a text (logprobs' token strings): a
        SentencePiece "▁hello" is " hello", which decoding it alone would strip."""
        if self._piece_spelling and id not in self._added_ids:
            return self.token_bytes(id).decode("utf-8", errors="replace")
        return self.backend.decode([id], skip_special_tokens=False)

    def token_bytes(self, id: int) -> bytes:
        """The bytes the token adds to a text (OpenAI's logprobs ``bytes``): a token holding
        part of a character gives that part, as its vocabulary piece spells it."""
        piece = self.backend.id_to_token(id)
        if piece is None or id in self._added_ids or not self._piece_spelling:
            return self.backend.decode([id], skip_special_tokens=False).encode()
        if self._piece_spelling == "byte-level":
            alphabet = _byte_level_alphabet()
            if all(ch in alphabet for ch in piece):
                return bytes(alphabet[ch] for ch in piece)
            return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    @functools.cached_property
    def _piece_spelling(self) -> str:
        """How the vocabulary's pieces spell bytes, from the decoder: "byte-level" (GPT-2's
        alphabet), "sentencepiece" ("▁" a space, "<0xNN>" one byte), or "" (neither)."""
        decoder = self.backend.decoder
        spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
        kinds = {d.get("type") for d in spec.get("decoders", [spec])}
        if "ByteLevel" in kinds:
            return "byte-level"
        return "sentencepiece" if kinds & {"Metaspace", "Replace", "ByteFallback"} else ""

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    def _special_text(self, id: int | None) -> str:
        return "" if id is None else (self.backend.id_to_token(id) or "")

    @property
    def bos_token(self) -> str:
        return self._special_text(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self._special_text(self.eos_token_ids[0] if self.eos_token_ids else None)

    # -- chat --------------------------------------------------------------------------------

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    max_chars: int | None = None, **extra: Any) -> list[int]:
        """The token ids of `messages` rendered with the chat template. A rendering longer
        than `max_chars` raises PromptTooLong before it is encoded."""
        text = self.apply_chat_template(messages, add_generation_prompt, max_chars=max_chars,
                                        **extra)
        if max_chars is not None and len(text) > max_chars:
            raise PromptTooLong(len(text))
        # The template writes any BOS it wants.
        return self.encode(text, add_special_tokens=False)

    def __getstate__(self) -> dict[str, Any]:
        # The compiled templates are caches, and Jinja's do not pickle: built again where used
        # (a server process gets its engine's tokenizer pickled).
        return {**self.__dict__, "_template": None, "_tool_use": None}

    def set_chat_template(self, template: str) -> None:
        """Use ``template`` in place of the model's, its named ones too (compiled now:
        ValueError if it is bad)."""
        self.chat_template, self._template = template, None
        self.tool_use_template, self._tool_use = None, None
        self._compiled_template()

    @property
    def template_takes_tools(self) -> bool:
        """Whether the template a chat with tools renders with (the "tool_use" one where the
        model has one) reads the `tools` variable; False where there is none to render with
        (rendering then says why)."""
        try:
            return self._tools_template().takes_tools
        except ValueError:
            return False

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None, max_chars: int | None = None,
        **extra: Any) -> str:
        """Render `messages` with the model's template, or with tools its "tool_use" one
        where it has one (chat_template.py says how). The template's own variables come as
        `chat_template_kwargs` (a client's: no name of theirs can clash with a parameter
        here) or as keywords. Past `max_chars` the rendering stops (ChatTemplate.render)."""
        extra = {**(chat_template_kwargs or {}), **extra}
        template = self._tools_template() if tools else self._compiled_template()
        return template.render(
            messages, add_generation_prompt, self.bos_token, self.eos_token, tools,
            continue_final_message, extra, max_chars)

    def _tools_template(self) -> ChatTemplate:
        if not self.tool_use_template:
            return self._compiled_template()
        if self._tool_use is None:
            self._tool_use = ChatTemplate(self.tool_use_template)
        return self._tool_use

    def _compiled_template(self) -> ChatTemplate:
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        if self._template is None:
            self._template = ChatTemplate(self.chat_template)
        return self._template
