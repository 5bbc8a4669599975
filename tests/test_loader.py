"""Model-file loading and the tokenizer, checked against transformers as an independent reader."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors import torch as safetensors_torch

from pagedserve.models.gguf_file import read_gguf
from pagedserve.models.loader import ModelLoadError, default_model_path, load_model_files
from pagedserve.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TEXTS = [
    "Hello, world!",
    "12345",
    "pi is 3.14159, a million is 1,000,000 and 2024-06-01",
    "multiple   spaces  here",
    "  leading and trailing  ",
    "line one\nline two\n\n\tindented\r\nwindows",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(12))\n",
    "café naïve résumé Ångström",
    "日本語のテキスト 中文 한국어",
    "emoji 🙂👍🏽 and flags 🇫🇷",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>pagedserve<file_sep>",
    "don't I'll we've THEY'RE",
    "\u00a0nbsp and zero\u200bwidth",
    "",
]
CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    [{"role": "user", "content": "Bonjour, ça va ? 🙂"}],
]


@pytest.fixture(scope="module")
def ours(embedded):
    return embedded


@pytest.fixture(scope="module")
def reference(hf_from_gguf):
    """transformers' model state dict and tokenizer, read from the same embedded GGUF."""
    directory, filename = os.path.split(default_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    return hf_from_gguf.state_dict(), tok


def test_embedded_config(ours):
    cfg = ours.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 8192 and cfg.tie_word_embeddings
    assert cfg.architecture == "LlamaForCausalLM" and not cfg.attention_bias and not cfg.qk_norm
    assert ours.name == "SmolLM2-135M-Instruct"
    assert "lm_head.weight" not in ours.weights


def test_gguf_weights_match_transformers(ours, reference):
    state, _ = reference
    expected = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied: a view of embed
    assert sorted(ours.weights) == sorted(expected)
    for name, tensor in expected.items():
        assert (
            ours.weights[name].dtype == torch.float32 and ours.weights[name].shape == tensor.shape
        )
        # Bit-equal today; the tolerance only admits a different fp32 rounding order.
        # (torch.equal first: assert_close over 135M elements costs seconds.)
        if not torch.equal(ours.weights[name], tensor):
            torch.testing.assert_close(ours.weights[name], tensor, rtol=1e-6, atol=1e-6, msg=name)


def test_gguf_tokenizer_matches_transformers(ours, reference):
    _, ref = reference
    tok = ours.tokenizer
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"
    assert tok.token_text(2) == "<|im_end|>" and tok.token_text(216) == " "


def test_chat_template_matches_transformers(ours, reference):
    _, ref = reference
    for messages in CONVERSATIONS:
        for gen in (True, False):
            want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.tokenizer.apply_chat_template(messages, add_generation_prompt=gen) == want


@pytest.mark.parametrize("prefix", ["The color is", "The color is ", "4", "", "end"])
def test_continue_final_message_matches_transformers(ours, reference, prefix):
    """The final assistant message left open, to be continued (HF's and vLLM's flag): the
    rendering ends after its text; "4" also appears earlier, "" is nowhere to be found and
    "end" is inside the turn's closing <|im_end|>: each is cut where the message ends."""
    _, ref = reference
    messages = [*CONVERSATIONS[0], {"role": "assistant", "content": prefix}]
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                   continue_final_message=True)
    got = ours.tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                             continue_final_message=True)
    assert got == want and got.endswith("<|im_start|>assistant\n" + prefix)


def test_chat_template_errors(ours):
    tok = ours.tokenizer
    bare = Tokenizer(tok.backend, bos_token_id=None, eos_token_ids=[2], add_bos=False)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    bare.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        bare.apply_chat_template([])
    bare = Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=[2, 0, 2], add_bos=True)
    assert bare.encode("hi")[0] == 1 and bare.encode("hi", add_special_tokens=False)[0] != 1
    assert bare.eos_token_ids == [2, 0]


def test_keep_last_cuts_the_text_and_keeps_its_bos_and_eos(ours):
    """transformers' truncation on the left, as vLLM's truncate_prompt_tokens cuts a text:
    the ids encode() adds at either end stay, the text's first tokens go."""
    tok = Tokenizer(ours.tokenizer.backend, bos_token_id=1, eos_token_ids=[2], add_bos=True,
                    add_eos=True)
    text = "one two three four five six seven"
    bare = tok.encode(text, add_special_tokens=False)
    ids = tok.encode(text)
    assert ids == [1, *bare, 2]
    assert tok.keep_last(ids, 5) == [1, *bare[-3:], 2]
    assert tok.keep_last(ids, len(ids)) == ids
    assert tok.keep_last(bare, 4, add_special_tokens=False) == bare[-4:]


# -- tiny GGUF files written here, with llama.cpp's Q/K permutation done independently ---------

BYTE_TOKENS = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)]
BYTE_TOKENS += [chr(c) for c in range(174, 256)] + [chr(256 + i) for i in range(68)]


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py: rotate-half halves -> interleaved pairs, per head.
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# HF leaf -> (GGUF leaf, shape) for the tiny models: hidden 32, 4 heads, 2 KV heads, head_dim 16.
TINY_LAYER = {
    "input_layernorm.weight": ("attn_norm.weight", (32,)),
    "self_attn.q_proj.weight": ("attn_q.weight", (64, 32)),
    "self_attn.k_proj.weight": ("attn_k.weight", (32, 32)),
    "self_attn.v_proj.weight": ("attn_v.weight", (32, 32)),
    "self_attn.o_proj.weight": ("attn_output.weight", (32, 64)),
    "post_attention_layernorm.weight": ("ffn_norm.weight", (32,)),
    "mlp.gate_proj.weight": ("ffn_gate.weight", (48, 32)),
    "mlp.up_proj.weight": ("ffn_up.weight", (48, 32)),
    "mlp.down_proj.weight": ("ffn_down.weight", (32, 48)),
}
TINY_BIAS = {
    f"self_attn.{n}_proj.bias": (f"attn_{n}.bias", (s,))
    for n, s in zip("qkv", (64, 32, 32), strict=True)
}
TINY_QK_NORM = {
    "self_attn.q_norm.weight": ("attn_q_norm.weight", (16,)),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", (16,)),
}


def _tiny_weights(bias: bool, qk_norm: bool, tie: bool) -> dict[str, tuple[str, np.ndarray]]:
    """HF name -> (GGUF name, random values)."""
    rng = np.random.default_rng(0)
    spec = {
        "model.embed_tokens.weight": ("token_embd.weight", (257, 32)),
        "model.norm.weight": ("output_norm.weight", (32,)),
    }
    if not tie:
        spec["lm_head.weight"] = ("output.weight", (257, 32))
    layer = TINY_LAYER | (TINY_BIAS if bias else {}) | (TINY_QK_NORM if qk_norm else {})
    for i in range(2):
        spec |= {f"model.layers.{i}.{k}": (f"blk.{i}.{g}", s) for k, (g, s) in layer.items()}
    return {k: (g, rng.standard_normal(s).astype(np.float32)) for k, (g, s) in spec.items()}


def _llama3_rope_factors() -> np.ndarray:
    """What llama.cpp stores as rope_freqs: default / llama3-scaled inverse frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(LLAMA3_ROPE, rope_theta=500000.0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=16384, rope_parameters=rope
    )
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    return (base / inv.double()).numpy().astype(np.float32)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _write_gguf(path, arch: str, weights: dict[str, tuple[str, np.ndarray]], sp: bool = False,
                heads: int = 4, kv_heads: int = 2, key_length: int | None = 16,
                merges: tuple[str, ...] = ()):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(32)
    w.add_feed_forward_length(48)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if key_length is not None:
        w.add_key_length(key_length)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama" if sp else "gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
    w.add_token_list([*BYTE_TOKENS, "<|end|>"])
    w.add_token_types([1] * 256 + [3])
    w.add_token_merges(list(merges))
    w.add_eos_token_id(256)
    if arch == "qwen3":  # llama.cpp's sampling defaults, as its converter writes them
        w.add_float32("general.sampling.temp", 0.6)
        w.add_int32("general.sampling.top_k", 20)
    if arch == "llama":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors())
    elif arch == "qwen3":  # llama.cpp's reading: a factor without a type is linear (old key)
        w.add_float32("qwen3.rope.scale_linear", 2.0)
    else:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(2.0)
    for name, (gname, value) in weights.items():
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            value = _llamacpp_permute(value, 4 if ".q_proj." in name else 2)
        w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    ("arch", "tie", "bias", "qk_norm", "dtype"),
    [
        ("llama", False, False, False, torch.float32),
        ("qwen2", True, True, False, torch.float32),
        ("qwen3", False, False, True, torch.bfloat16),
    ],
)
def test_tiny_gguf_roundtrip(tmp_path, arch, tie, bias, qk_norm, dtype):
    weights = _tiny_weights(bias, qk_norm, tie)
    path = tmp_path / f"tiny-{arch}.Q8_0.gguf"
    _write_gguf(path, arch, weights)
    loaded = load_model_files(str(path), dtype=dtype)
    cfg = loaded.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (2, 32, 4, 2)
    assert (cfg.head_dim, cfg.vocab_size, cfg.rope_theta, cfg.rms_norm_eps) == (16, 257, 5e5, 1e-6)
    want_rope = LLAMA3_ROPE if arch == "llama" else {"rope_type": "linear", "factor": 2.0}
    assert cfg.rope_scaling == want_rope
    assert (cfg.tie_word_embeddings, cfg.attention_bias, cfg.qk_norm) == (tie, bias, qk_norm)
    assert loaded.name == f"tiny-{arch}"
    assert sorted(loaded.weights) == sorted(weights)
    for name, (_, value) in weights.items():
        want = torch.from_numpy(value).to(dtype)
        torch.testing.assert_close(loaded.weights[name], want, rtol=0, atol=0, msg=name)
    assert loaded.tokenizer.eos_token_ids == [256]
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("a b<|end|>")) == "a b"
    want = {"temperature": 0.6, "top_k": 20} if arch == "qwen3" else {}
    assert loaded.sampling_defaults == want


@pytest.mark.parametrize("tweak, message", [
    ({"heads": 0, "key_length": None}, "incomplete llama metadata"),  # was a ZeroDivisionError
    ({"kv_heads": 3}, "4 attention heads do not share 3 KV heads evenly"),  # was the 1st step's
    ({"merges": ("a zz",)}, "cannot build tokenizer"),  # the tokenizers library's bare Exception
])
def test_gguf_metadata_no_kernel_can_run_is_one_error(tmp_path, tweak, message):
    path = tmp_path / "bad.gguf"
    _write_gguf(path, "llama", _tiny_weights(False, False, True), **tweak)
    with pytest.raises(ModelLoadError, match=message):
        load_model_files(str(path))


def test_sentencepiece_gguf_is_refused(tmp_path):
    path = tmp_path / "sp.gguf"
    _write_gguf(path, "qwen2", _tiny_weights(False, False, True), sp=True)
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'llama'"):
        Tokenizer.from_gguf(read_gguf(str(path)).fields)
    with pytest.raises(ModelLoadError, match="sp.gguf"):
        load_model_files(str(path))


# -- Hugging Face directories ------------------------------------------------------------------

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("variant", ["llama", "llama-tied-sharded", "qwen2"])
def test_hf_dir(tmp_path, ours, variant):
    common = dict(
        vocab_size=ours.tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=variant == "llama-tied-sharded",
    )
    torch.manual_seed(0)
    if variant == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    shard = "2MB" if "sharded" in variant else "1GB"
    model_dir = tmp_path / variant
    model.save_pretrained(model_dir, max_shard_size=shard)
    assert ("sharded" in variant) == (model_dir / "model.safetensors.index.json").exists()
    ours.tokenizer.backend.save(str(model_dir / "tokenizer.json"))
    tcfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": TEMPLATE}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tcfg | {"add_bos_token": False}))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    loaded = load_model_files(str(model_dir))
    cfg = loaded.config
    assert loaded.name == variant
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        2, 64, 4, 2, 16,
    )  # fmt: skip
    assert cfg.tie_word_embeddings == common["tie_word_embeddings"]
    assert cfg.attention_bias == (variant == "qwen2")
    state = {k: v for k, v in model.state_dict().items() if "rotary" not in k}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    assert sorted(loaded.weights) == sorted(state)
    for name, value in state.items():
        torch.testing.assert_close(loaded.weights[name], value, rtol=0, atol=0, msg=name)

    tok = loaded.tokenizer
    assert tok.eos_token_ids == [2, 0] and tok.bos_token_id == 1 and not tok.add_bos
    for text in TEXTS:
        assert tok.encode(text) == ours.tokenizer.encode(text)
    messages = CONVERSATIONS[1]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>user\nBonjour, ça va ? 🙂<|im_end|>\n<|im_start|>assistant\n"
    )
    (model_dir / "generation_config.json").write_text("{eos: 2}")
    with pytest.raises(ModelLoadError, match="generation_config.json: Expecting property"):
        load_model_files(str(model_dir))


def test_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no-such-model"):
        load_model_files(str(tmp_path / "no-such-model"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="empty"):
        load_model_files(str(empty))
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    with pytest.raises(ModelLoadError, match="notes.gguf"):
        load_model_files(str(text))
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model_files(str(empty))
    cfg = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1)
    (empty / "config.json").write_text(json.dumps(cfg | {"num_attention_heads": 2}))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model_files(str(empty))
    safetensors_torch.save_file({"model.norm.weight": torch.ones(8)}, empty / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing weight model.embed_tokens.weight"):
        load_model_files(str(empty))


@pytest.mark.parametrize("name, content, message", [
    ("tokenizer.json", "{", "cannot load tokenizer \\(tokenizer.json: EOF"),
    ("tokenizer.json", "{}", "cannot load tokenizer \\(tokenizer.json: "),
    ("tokenizer_config.json", "[]", "tokenizer_config.json: a JSON object is needed"),
    ("generation_config.json", '{"eos_token_id": [null]}', "eos_token_id must be a token id"),
    ("tokenizer_config.json", '{"chat_template": 5}', "chat_template must be a string"),
    ("tokenizer_config.json", '{"chat_template": [{"name": "default"}]}',
     "chat_template must be a string"),
])
def test_a_malformed_file_of_a_model_dir_is_a_load_error(tmp_path, tiny_llama_dir, name,
                                                         content, message):
    """Each one a ModelLoadError naming the file (the CLI's and the server's one line), not
    whatever the parser happened to raise (tokenizers' bare Exception, an AttributeError)."""
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / name).write_text(content)
    with pytest.raises(ModelLoadError, match=message):
        load_model_files(str(model_dir))
