"""vLLM's --chat-template (a template in place of the model's, inline or in a file) and
chat_template_kwargs (the template's own variables, such as Qwen3's enable_thinking), on the
tokenizer and through a live server's chat and /tokenize."""

import httpx
import pytest
from test_server_utils import RemoteServer, openai_error

from pagedserve.models.loader import load_model_files

# Renders a thinking switch the way Qwen3's template reads it, then the turns.
TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
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


@pytest.mark.slow
def test_served_with_a_template_file_and_kwargs(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    srv = RemoteServer("--chat-template", str(path)).wait_ready()
    try:
        def rendered(**body) -> str:
            r = httpx.post(srv.url + "/tokenize", json={"messages": HI, **body}, timeout=60)
            tokens = r.json()["tokens"]
            text = httpx.post(srv.url + "/detokenize", json={"tokens": tokens}, timeout=60)
            return text.json()["prompt"]

        # The file's template: the model's own adds a system prompt.
        assert rendered() == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        assert rendered(chat_template_kwargs={"enable_thinking": False}).startswith(
            "[no-think]<|im_start|>user\nHi")
        chat = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "messages": HI, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
        assert chat.status_code == 200, chat.text
        bad = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": HI, "chat_template_kwargs": {"messages": []}})
        assert openai_error(bad, 400)["param"] == "chat_template_kwargs"
    finally:
        srv.stop()
