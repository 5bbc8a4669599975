"""vLLM's --chat-template (a template in place of the model's, inline or in a file) and
chat_template_kwargs (the template's own variables, such as Qwen3's enable_thinking), on the
tokenizer and through a live server's chat and /tokenize."""

import httpx
import pytest
from test_server_utils import RemoteServer, openai_error, sse_events

from pagedserve.models import chat_template
from pagedserve.models.chat_template import ChatTemplate, template_message
from pagedserve.models.loader import load_model_files
from pagedserve.models.tokenizer import PromptTooLong

# Renders a thinking switch the way Qwen3's template reads it, then the turns.
TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}"
            "{% if documents %}[docs: {{ documents | length }}]{% endif %}"
            "{% if reasoning_effort %}[effort: {{ reasoning_effort }}]{% endif %}"
            "{% if tools %}[tools: {{ tools | length }}]{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n"
            "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
            "{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HI = [{"role": "user", "content": "Hi"}]


def test_a_template_in_place_of_the_models_and_its_variables():
    tok = load_model_files(None).tokenizer
    own = tok.apply_chat_template(HI)
    tok.set_chat_template(TEMPLATE)
    assert tok.apply_chat_template(HI) != own
    assert tok.apply_chat_template(HI, enable_thinking=False).startswith("[no-think]<|im_start|>")
    assert not tok.apply_chat_template(HI, enable_thinking=True).startswith("[no-think]")
    with pytest.raises(ValueError, match="set by the server"):
        tok.apply_chat_template(HI, bos_token="x")
    with pytest.raises(ValueError, match="invalid chat template"):
        tok.set_chat_template("{% for %}")
    # A value the template cannot use (a string and a number added): the request's error,
    # a ValueError (the server's 400), where it was a TypeError (a 500).
    tok.set_chat_template("{{ 'x' + n }}")
    with pytest.raises(ValueError, match="chat template error"):
        tok.apply_chat_template(HI, chat_template_kwargs={"n": 1})
    tok.set_chat_template("{{ ' ' * n }}")
    with pytest.raises(ValueError, match="chat template error: a repetition of more than"):
        tok.apply_chat_template(HI, chat_template_kwargs={"n": 10**13})


def test_a_template_cannot_take_the_servers_memory(monkeypatch):
    """A template is code (a request's own under --trust-request-chat-template): one of
    `'x' * 10**10` had the kernel kill the server. A repetition or a power past a bound is
    the template's error, filler text is not there to ask for, and a loop's output stops
    just past the prompt's character limit (PromptTooLong, the server's 400)."""
    tok = load_model_files(None).tokenizer
    for bad in ("{{ 'x' * 10**10 }}", "{{ ([1] * 10**8)|length }}", "{{ 10**10 * 'x' }}",
                "{{ 2 ** (10 ** 9) }}", "{{ lipsum(10**9) }}"):
        tok.set_chat_template(bad)
        with pytest.raises(ValueError, match="chat template error"):
            tok.apply_chat_template(HI)
    tok.set_chat_template("{{ '=' * 80 }}{{ 10 ** 10 }}{{ messages[0]['content'] }}")
    assert tok.apply_chat_template(HI) == "=" * 80 + "10000000000Hi"  # (what templates do)
    tok.set_chat_template("{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}")
    with pytest.raises(PromptTooLong) as e:  # (100 million characters otherwise)
        tok.encode_chat(HI, max_chars=1000)
    assert e.value.num_chars == 100000  # the first piece past the limit: it stopped there
    # with no caller's limit (a prompt cut to its last tokens, the offline chat): a bound
    monkeypatch.setattr(chat_template, "MAX_RENDERED_CHARS", 250000)
    with pytest.raises(ValueError, match="the rendering passed 250000 characters"):
        tok.apply_chat_template(HI)


# SmolLM3's kind: the assistant's text inside {% generation %} (transformers' training-mask
# tag), and Qwen3's kind: a turn's reasoning_content.
MARKED = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
          "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
          "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
          "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}")


def test_tags_and_reasoning_fields_render_as_transformers_renders_them():
    from transformers import PreTrainedTokenizerFast

    tok = load_model_files(None).tokenizer
    ref = PreTrainedTokenizerFast(tokenizer_object=tok.backend, bos_token=tok.bos_token,
                                  eos_token=tok.eos_token)
    tok.set_chat_template(MARKED)  # was "Encountered unknown tag 'generation'"
    for field in ("reasoning_content", "reasoning", "thinking"):  # HF's aliases
        messages = [*HI, {"role": "assistant", "content": "Hello!", field: "Greet back."}]
        want = ref.apply_chat_template(messages, tokenize=False, chat_template=MARKED)
        assert tok.apply_chat_template(messages, add_generation_prompt=False) == want
        assert "<think>Greet back.</think>Hello!" in want


@pytest.mark.slow
def test_served_with_a_template_file_and_kwargs(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    # The engine in a process of its own: the tokenizer, its template compiled at load, is
    # pickled to the server.
    with RemoteServer("--chat-template", str(path), "--frontend-multiprocessing",
                      "--trust-request-chat-template") as srv:
        def rendered(**body) -> str:
            r = httpx.post(srv.url + "/tokenize", json={"messages": HI, **body}, timeout=60)
            assert r.status_code == 200, r.text
            tokens = r.json()["tokens"]
            text = httpx.post(srv.url + "/detokenize", json={"tokens": tokens}, timeout=60)
            return text.json()["prompt"]

        # The file's template: the model's own adds a system prompt.
        assert rendered() == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        assert rendered(chat_template_kwargs={"enable_thinking": False}).startswith(
            "[no-think]<|im_start|>user\nHi")
        reasoned = {"role": "assistant", "content": "Hello", "reasoning": "Greet back."}
        assert "assistant\n<think>Greet back.</think>Hello<|im_end|>" in rendered(
            messages=[*HI, reasoned], add_generation_prompt=False)  # was dropped
        chat = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "messages": HI, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
        assert chat.status_code == 200, chat.text
        # vLLM's documents and reasoning_effort reach the template as its variables
        passed = {"documents": [{"title": "a", "text": "b"}], "reasoning_effort": "low"}
        assert rendered(chat_template_kwargs=passed).startswith("[docs: 1][effort: low]<|im")
        chat = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                          json={"messages": HI, "max_tokens": 1, **passed}).json()
        tokens = httpx.post(srv.url + "/tokenize", timeout=60, json={
            "messages": HI, "chat_template_kwargs": passed}).json()["count"]
        assert chat["usage"]["prompt_tokens"] == tokens
        # reasoning_effort "none" turns thinking off, unless chat_template_kwargs say
        def prompt_tokens(**body) -> int:
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                           json={"messages": HI, "max_tokens": 1, **body})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        def count(kwargs) -> int:
            return httpx.post(srv.url + "/tokenize", timeout=60, json={
                "messages": HI, "chat_template_kwargs": kwargs}).json()["count"]

        off = {"reasoning_effort": "none", "enable_thinking": False}
        assert rendered(chat_template_kwargs=off).startswith("[no-think][effort: none]")
        assert prompt_tokens(reasoning_effort="none") == count(off)
        on = {"reasoning_effort": "none", "enable_thinking": True}
        assert prompt_tokens(reasoning_effort="none", chat_template_kwargs={
            "enable_thinking": True}) == count(on) < count(off)
        assert prompt_tokens(reasoning_effort="xhigh") == count({"reasoning_effort": "xhigh"})
        # --trust-request-chat-template (vLLM's): a request's own template renders its chat,
        # in /tokenize as in chat (where it also decides whether tools reach the template)
        own = "{% for m in messages %}<{{ m['role'] }}:{{ m['content'] }}>{% endfor %}"
        assert rendered(chat_template=own) == "<user:Hi>"
        assert rendered(chat_template_kwargs={"chat_template": own}) == "<user:Hi>"
        assert prompt_tokens(chat_template=own) == httpx.post(srv.url + "/tokenize", json={
            "prompt": "<user:Hi>", "add_special_tokens": False}).json()["count"]
        assert rendered() == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        err = openai_error(httpx.post(srv.url + "/tokenize", json={
            "messages": HI, "chat_template": "{% for %}"}), 400)
        assert err["param"] == "chat_template"
        # a template that would take the server's memory (it was OOM-killed) is a 400
        big = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": HI, "max_tokens": 1, "chat_template": "{{ 'x' * 10**10 }}"})
        assert openai_error(big, 400)["message"].startswith("chat template error")
        # tool_choice "none": no calls are read, but a template that takes tools gets them
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        listed = httpx.post(srv.url + "/tokenize", timeout=60,
                            json={"messages": HI, "tools": tools}).json()["count"]
        assert prompt_tokens(tools=tools, tool_choice="none") == listed > count({})
        # continue_final_message (vLLM's): the last message left open and continued, in chat
        # as in /tokenize (it was ignored: the prompt closed the turn and opened a new one)
        opened = {"messages": [*HI, {"role": "assistant", "content": "The color is"}],
                  "add_generation_prompt": False, "continue_final_message": True}
        assert rendered(**opened).endswith("<|im_start|>assistant\nThe color is")
        tokens = httpx.post(srv.url + "/tokenize", json=opened, timeout=60).json()["tokens"]
        greedy = {"max_tokens": 6, "temperature": 0}
        chat = httpx.post(srv.url + "/v1/chat/completions", json={**opened, **greedy},
                          timeout=120).json()["choices"][0]["message"]["content"]
        plain = httpx.post(srv.url + "/v1/completions", json={"prompt": tokens, **greedy},
                           timeout=120).json()["choices"][0]["text"]
        assert chat == plain != ""
        # the answer's role (vLLM's): the last message's where no assistant turn was opened;
        # echo shows that message
        asked = {"messages": HI, "add_generation_prompt": False, "echo": True, **greedy}
        for stream in (False, True):
            r = httpx.post(srv.url + "/v1/chat/completions", json={**asked, "stream": stream},
                           timeout=120)
            if stream:
                deltas = [e["choices"][0]["delta"] for e in sse_events(r.text.splitlines())
                          if isinstance(e, dict) and e["choices"]]
                role, text = deltas[0]["role"], "".join(d.get("content") or "" for d in deltas)
            else:
                role, text = (r.json()["choices"][0]["message"][k] for k in ("role", "content"))
            assert role == HI[-1]["role"] == "user", r.text
            assert text.startswith(HI[-1]["content"]) and len(text) > len(HI[-1]["content"])
        opened_role = httpx.post(srv.url + "/v1/chat/completions", json={**opened, **greedy},
                                 timeout=120).json()["choices"][0]["message"]["role"]
        assert opened_role == "assistant"
        both = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                          json={**opened, "add_generation_prompt": True})
        assert openai_error(both, 400)["param"] == "continue_final_message"
        bad = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": HI, "chat_template_kwargs": {"messages": []}})
        assert openai_error(bad, 400)["param"] == "chat_template_kwargs"
        for kwargs in ({"max_chars": 1}, {"self": 1}):  # names of Python parameters: were 500s
            r = httpx.post(srv.url + "/tokenize", json={"messages": HI,
                                                        "chat_template_kwargs": kwargs})
            assert r.status_code == 200, r.text


def test_a_models_tool_use_template_is_used_with_tools(tmp_path):
    """Named templates (Hermes 3's: "default" and "tool_use"): with tools, transformers
    renders the tool_use one; read from tokenizer_config.json, or from a GGUF's
    tokenizer.chat_template.tool_use."""
    from pagedserve.models.tokenizer import Tokenizer

    named = [{"name": "default", "template": "plain:{{ messages[0].content }}"},
             {"name": "tool_use", "template": "tools:{{ tools | length }}:"
                                              "{{ messages[0].content }}"}]
    templates = Tokenizer._hf_chat_templates(str(tmp_path), {"chat_template": named})
    tok = load_model_files(None).tokenizer
    tok = Tokenizer(tok.backend, bos_token_id=None, eos_token_ids=[2], add_bos=False,
                    **templates)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert tok.apply_chat_template(HI) == "plain:Hi"
    assert tok.apply_chat_template(HI, tools=tools) == "tools:1:Hi"


def test_an_engines_template_leaves_a_shared_model_alone(embedded):
    from engine_utils import make_engine

    engine = make_engine(embedded, chat_template=TEMPLATE)
    assert engine.tokenizer.apply_chat_template(HI).startswith("<|im_start|>user")
    assert embedded.tokenizer.chat_template != TEMPLATE  # other engines of it: the model's


def test_an_assistants_refusal_part_reaches_the_template_as_its_text():
    """OpenAI's assistant content parts are text or refusal; vLLM reads a refusal as text.
    (It was a 400: "content parts of type 'refusal' are not supported".)"""
    from pagedserve.server.chat_messages import template_messages
    from pagedserve.server.protocol import ChatCompletionRequest

    def rendered(content):
        req = ChatCompletionRequest.model_validate(
            {"messages": [*HI, {"role": "assistant", "content": content}, *HI]})
        return template_messages(req.messages)

    parts = [{"type": "refusal", "refusal": "I can't."}, {"type": "text", "text": "Ask again."}]
    assert rendered(parts) == rendered("I can't.\nAsk again.")


@pytest.mark.slow
def test_tools_left_out_of_the_prompt_for_tool_choice_none_when_asked(tmp_path):
    """vLLM's --exclude-tools-when-tool-choice-none: a template that reads tools gets none
    where tool_choice is "none" (and still gets them for "auto")."""
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with RemoteServer("--chat-template", str(path),
                      "--exclude-tools-when-tool-choice-none") as srv:
        def prompt(**body) -> int:
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                           json={"messages": HI, "max_tokens": 1, **body})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        assert prompt(tools=tools, tool_choice="none") == prompt() < prompt(tools=tools)


def test_a_message_in_openais_form_as_templates_read_it():
    from pagedserve.models.chat_template import template_message

    said = template_message({"role": "assistant", "content": None, "tool_calls": [],
                             "reasoning": "Think."})
    assert said == {"role": "assistant", "content": "", "reasoning_content": "Think."}
    call = {"id": None, "type": "function", "function": {"name": "f", "arguments": " "}}
    assert template_message({"role": "developer", "content": [
        {"type": "text", "text": "a"}, {"type": "refusal", "refusal": "b"}],
        "tool_calls": [call]}) == {"role": "system", "content": "a\nb", "tool_calls": [
            {"id": None, "type": "function", "function": {"name": "f", "arguments": {}}}]}


def test_tojson_keeps_non_ascii_text_as_transformers_does():
    template = ChatTemplate("{% for m in messages %}{{ m['content'] | tojson }}"
                            "{{ m | tojson(indent=1) }}{% endfor %}")
    text = template.render([{"role": "user", "content": "Tōkyō 東京"}], False, "", "")
    assert text.startswith('"Tōkyō 東京"') and "\\u" not in text


def test_reasoning_content_given_wins_over_reasoning():
    """Both names given: reasoning_content is kept (reasoning is only its other name)."""
    out = template_message({"role": "assistant", "content": "x", "reasoning_content": "mine",
                            "reasoning": "other"})
    assert out["reasoning_content"] == "mine" and "reasoning" not in out
    alias = template_message({"role": "assistant", "content": "x", "reasoning": "other"})
    assert alias["reasoning_content"] == "other"


def test_block_tags_leave_no_lines_or_indents_as_in_transformers():
    """transformers compiles templates with trim_blocks and lstrip_blocks: a block tag on a
    line of its own leaves neither the line's indent nor its newline in the text."""
    template = ChatTemplate("{% for m in messages %}\n    {% if m.content %}\n"
                            "{{ m.content }}\n    {% endif %}\n{% endfor %}")
    assert template.render(HI + [{"role": "user", "content": "Yo"}], False, "", "") \
        == "Hi\nYo\n"


def test_a_rendering_of_exactly_max_chars_is_taken():
    from pagedserve.models.tokenizer import PromptTooLong

    tok = load_model_files(None).tokenizer
    n = len(tok.apply_chat_template(HI, True))
    assert tok.encode_chat(HI, max_chars=n) == tok.encode_chat(HI)
    with pytest.raises(PromptTooLong):
        tok.encode_chat(HI, max_chars=n - 1)
