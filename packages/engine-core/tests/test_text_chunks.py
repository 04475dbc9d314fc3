"""Streamed text chunks spliced into a template are byte for byte the events pydantic renders."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from loom.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionStreamChoice,
    CompletionChoice,
    CompletionChunk,
    DeltaMessage,
    TextChunks,
    sse,
)

# Any text a detokenizer can produce: every code point but lone surrogates (not UTF-8).
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


def chat(index: int, text: str) -> str:
    return sse(ChatCompletionChunk(id="chatcmpl-1\"\\é", created=1764900000, model="m/ü\n",
                                   choices=[ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=text))]))


def completion(index: int, text: str) -> str:
    return sse(CompletionChunk(id="cmpl-7", created=1, model="SmolLM2-135M-Instruct",
                               choices=[CompletionChoice(index=index, text=text)]))


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(st.tuples(st.integers(0, 3), TEXT), min_size=1, max_size=8))
def test_spliced_events_equal_rendered_ones(texts):
    for render in (chat, completion):
        chunks = TextChunks(render)
        for index, text in texts:
            assert chunks(index, text) == render(index, text)


def test_control_characters_quotes_and_the_placeholder_itself():
    chunks = TextChunks(chat)
    for text in ["\x00", "\x1f\x7f\u2028\u2029", '"\\/', "\t\n\r\b\f", TextChunks._MARK, "é😀中", "\ud7ff\ue000"]:
        assert chunks(0, text) == chat(0, text)
        assert json.loads(chunks(0, text)[len("data: "):])["choices"][0]["delta"]["content"] == text


def test_a_render_without_the_placeholder_is_used_for_every_event():
    calls = []

    def render(index: int, text: str) -> str:  # a renderer that changes its text: nothing to splice into
        calls.append(text)
        return f"data: {json.dumps(text.upper())}\n\n"

    chunks = TextChunks(render)
    assert chunks(0, "ab") == 'data: "AB"\n\n' and chunks(0, "c") == 'data: "C"\n\n'
    assert calls == [TextChunks._MARK, "ab", "c"]


def test_a_field_equal_to_the_placeholder_makes_every_event_rendered_in_full():
    def render(index: int, text: str) -> str:  # a served model name that is the placeholder itself
        return sse(ChatCompletionChunk(id="c", created=1, model=TextChunks._MARK, choices=[
            ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=text))]))

    chunks = TextChunks(render)
    for text in ["a", "", TextChunks._MARK]:
        assert chunks(0, text) == render(0, text)
    assert chunks._parts == {0: None}
