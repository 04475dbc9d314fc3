"""loom's torch-free ``FastTokenizer`` against transformers' tokenizer on the same files."""

from __future__ import annotations

import pytest
from loom.model_loader.gguf_loader import ensure_gguf_cache
from loom.transformers_utils.config import HFConfig, default_model_path
from loom.transformers_utils.fast_tokenizer import FastTokenizer
from transformers import AutoTokenizer

TEXTS = [
    "Hello, my name is",
    "It's  a test .  \n\n ünïcode 😀 and   spaces\t",
    "<|endoftext|>special<|im_start|>user\nhi<|im_end|>",
    "",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? Say it's \"Rome\"."},
]


@pytest.fixture(scope="module", params=["gpt2", "smollm2"])
def tokenizer_dir(request, tiny_llama):
    if request.param == "gpt2":
        return str(tiny_llama)
    try:
        return ensure_gguf_cache(default_model_path())
    except FileNotFoundError as e:
        pytest.fail(f"the default model is part of the test matrix: {e}")


def test_encode_decode_match_transformers(tokenizer_dir):
    ours, theirs = FastTokenizer(tokenizer_dir), AutoTokenizer.from_pretrained(tokenizer_dir)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
            assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
            tokens = ours.convert_ids_to_tokens(ids, skip_special_tokens=True)
            assert tokens == theirs.convert_ids_to_tokens(ids, skip_special_tokens=True)
            assert ours.convert_tokens_to_string(tokens) == theirs.convert_tokens_to_string(tokens)
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.all_special_ids == sorted(theirs.all_special_ids)
    assert len(ours) == len(theirs)


def test_chat_template_matches_transformers(tokenizer_dir):
    ours, theirs = FastTokenizer(tokenizer_dir), AutoTokenizer.from_pretrained(tokenizer_dir)
    assert ours.chat_template == theirs.chat_template and ours.chat_template
    for add in (True, False):
        text = ours.apply_chat_template(CONVERSATION, add_generation_prompt=add, tokenize=False)
        assert text == theirs.apply_chat_template(CONVERSATION, add_generation_prompt=add, tokenize=False)
        assert ours.apply_chat_template(CONVERSATION, add_generation_prompt=add) == \
            theirs.apply_chat_template(CONVERSATION, add_generation_prompt=add, return_dict=True)["input_ids"]
    custom = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] | tojson }}\n{% endfor %}"
    assert ours.apply_chat_template(CONVERSATION, chat_template=custom, tokenize=False) == \
        theirs.apply_chat_template(CONVERSATION, chat_template=custom, tokenize=False)


def test_chat_template_errors_are_raised(tiny_llama):
    from jinja2.exceptions import TemplateError

    ours = FastTokenizer(str(tiny_llama))
    with pytest.raises(TemplateError, match="no system"):
        ours.apply_chat_template(CONVERSATION, chat_template="{{ raise_exception('no system') }}")


def test_hf_config_defaults_and_rope_forms(tmp_path):
    cfg = HFConfig({"model_type": "llama", "hidden_size": 64, "torch_dtype": "bfloat16"})
    assert cfg.rms_norm_eps == 1e-6 and cfg.hidden_act == "silu" and cfg.tie_word_embeddings is False
    assert cfg.dtype == "bfloat16" and cfg.hidden_size == 64
    assert not hasattr(cfg, "rope_theta")  # a default would shadow transformers 5's rope_parameters
    assert HFConfig({"model_type": "opt"}).do_layer_norm_before is True
    assert HFConfig({"model_type": "something_else"}).tie_word_embeddings is True


def test_generation_tag_renders_like_the_cli_accepts_it(tiny_llama):
    from loom.entrypoints.chat_utils import load_chat_template

    template = load_chat_template(
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}A: {{ m['content'] }}"
        "{% endgeneration %}{% else %}U: {{ m['content'] }}{% endif %}\n{% endfor %}")
    text = FastTokenizer(str(tiny_llama)).apply_chat_template(CONVERSATION[1:3], chat_template=template,
                                                              tokenize=False)
    assert text == "U: What is the capital of France?A: Paris."  # trim_blocks eats the newlines
    theirs = AutoTokenizer.from_pretrained(str(tiny_llama))
    assert text == theirs.apply_chat_template(CONVERSATION[1:3], chat_template=template, tokenize=False)
