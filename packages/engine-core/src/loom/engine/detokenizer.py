"""Token ids -> text, one token at a time, with stop strings.

Two paths. ``IncrementalDetokenizer`` runs per token for requests that stream or have
stop strings: new text as soon as it is whole (a character split across tokens waits
for its last byte), and the stop-string check. A request with neither is decoded once,
at the end, by ``decode_final``: the cheaper path, and the same text.

Both decode the output after a few prompt tokens of context, so the first output token
reads as it does in context (a SentencePiece vocabulary drops a leading space at the
start of a text, not in the middle).
"""

from __future__ import annotations

from typing import Any

from loom_plugin_api import SamplingParams

from ..logger import init_logger

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # an old tokenizers: the prefix/read-offset path below does the work
    DecodeStream = None

logger = init_logger(__name__)

_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence
_INVALID_PREFIX = "Invalid prefix encountered"


def prompt_context(tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> list[int]:
    """The shortest prompt suffix of 4 to 24 tokens that starts on a character boundary."""
    n = len(prompt_token_ids)
    for length in range(min(4, n), min(24, n) + 1):
        suffix = prompt_token_ids[n - length:]
        if _REPLACEMENT not in tokenizer.decode(suffix, skip_special_tokens=skip_special_tokens):
            return suffix
    return []


def decode_final(
    tokenizer: Any, prompt_token_ids: list[int], output_token_ids: list[int], params: SamplingParams,
    stop_terminated: bool,
) -> str:
    """The whole output text at once (requests without stop strings that don't stream).

    ``stop_terminated``: the last token is EOS or a stop token id; its text is left out
    unless ``include_stop_str_in_output``.
    """
    ids = output_token_ids
    if stop_terminated and not params.include_stop_str_in_output:
        ids = ids[:-1]
    if not ids:
        return ""
    skip = params.skip_special_tokens
    context = prompt_context(tokenizer, prompt_token_ids, skip)
    if not context:
        return tokenizer.decode(ids, skip_special_tokens=skip)
    prefix = tokenizer.decode(context, skip_special_tokens=skip)
    full = tokenizer.decode(context + ids, skip_special_tokens=skip)
    if full.startswith(prefix):
        return full[len(prefix):]
    return tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    """Per-request incremental decoding and stop-string matching.

    Uses ``tokenizers.decoders.DecodeStream`` with a fast tokenizer, else vLLM's
    prefix/read-offset algorithm over ``convert_ids_to_tokens``.
    """

    __slots__ = (
        "tokenizer", "backend", "skip_special_tokens", "stop", "include_stop_str", "stop_buffer_length",
        "output_text", "_sent_offset", "_stream", "_tokens", "_prefix_offset", "_read_offset",
    )

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams, use_decode_stream: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop_str = params.include_stop_str_in_output
        # While streaming, hold back the text that could still turn out to be the start of a
        # stop string, so a client never sees text that is cut afterwards.
        max_stop = max((len(s) for s in self.stop), default=0)
        self.stop_buffer_length = 0 if self.include_stop_str else max(max_stop - 1, 0)
        self.output_text = ""
        self._sent_offset = 0
        context = prompt_context(tokenizer, prompt_token_ids, self.skip_special_tokens)
        self.backend = getattr(tokenizer, "backend_tokenizer", None) if use_decode_stream else None
        self._stream = None
        if self.backend is not None and DecodeStream is not None:
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            for token_id in context:  # one by one: older tokenizers take no list here
                self._stream.step(self.backend, token_id)
        else:
            self._tokens: list[str] = tokenizer.convert_ids_to_tokens(
                context, skip_special_tokens=self.skip_special_tokens
            )
            self._read_offset = len(self._tokens)
            self._prefix_offset = max(self._read_offset - 5, 0)

    def update(self, token_id: int, stop_terminated: bool = False, check_stop: bool = True) -> str | None:
        """Decode one more token; returns the stop string it completed, if any.

        ``stop_terminated``: this token is EOS or a stop token id that ended the request;
        its text is not part of the output unless ``include_stop_str_in_output``.
        ``check_stop``: False while the request is under ``min_tokens`` (no stop applies yet).
        """
        if stop_terminated and not self.include_stop_str:
            return None
        new_text = self._step(token_id) if self._stream is not None else self._step_slow(token_id)
        if not new_text:
            return None
        offset = len(self.output_text)
        self.output_text += new_text
        return self._check_stop(offset) if self.stop and check_stop else None

    def _check_stop(self, offset: int) -> str | None:
        """Find a stop string that ends in the text added after ``offset``; truncate there."""
        text = self.output_text
        best: tuple[int, str] | None = None
        for stop in self.stop:
            idx = text.find(stop, max(offset - len(stop) + 1, 0))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.output_text = text[:idx + len(stop)] if self.include_stop_str else text[:idx]
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show now: all of it, or only what is new since the last call (delta)."""
        length = len(self.output_text) - (0 if finished else self.stop_buffer_length)
        if not delta:
            return self.output_text[:max(length, 0)]
        start = self._sent_offset
        if length <= start:
            return ""
        self._sent_offset = length
        return self.output_text[start:length]

    def _step(self, token_id: int) -> str:
        try:
            return self._stream.step(self.backend, token_id) or ""
        except (OverflowError, TypeError):
            return ""  # an id past the tokenizer's vocabulary (padded embedding rows)
        except Exception as e:
            # DecodeStream refuses when the text of what it holds changes as tokens arrive
            # (some normalizing decoders); start it over from this token.
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            logger.debug("DecodeStream reset after %r", e)
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self._stream.step(self.backend, token_id) or ""

    def _step_slow(self, token_id: int) -> str:
        # vLLM's algorithm: decode a window that starts a few tokens back, and emit what the
        # new token adds to it once that text no longer ends in a partial character.
        new_tokens = self.tokenizer.convert_ids_to_tokens([token_id], skip_special_tokens=self.skip_special_tokens)
        tokens = self._tokens
        tokens.extend(t for t in new_tokens if t is not None)
        convert = self.tokenizer.convert_tokens_to_string
        prefix_text = convert(tokens[self._prefix_offset:self._read_offset])
        new_text = convert(tokens[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        if self._prefix_offset > 64:  # keep the window list short
            del tokens[:self._read_offset]
            self._read_offset = 0
        self._prefix_offset = self._read_offset
        self._read_offset = len(tokens)
        return new_text[len(prefix_text):]
