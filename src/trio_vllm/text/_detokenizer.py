"""Incremental detokenization and stop strings, as vLLM 0.32.0's ``v1/engine/detokenizer.py``.

One detokenizer per request (per child of an ``n > 1`` request). `update` takes the
token ids of one engine output, appends their text and checks the stop strings;
`get_next_output_text` hands out text for DELTA or CUMULATIVE outputs, holding back
the last ``max(len(stop)) - 1`` characters while streaming (a stop string may still
complete there and must then not have been shown).

* `FastIncrementalDetokenizer`: ``tokenizers``' ``DecodeStream`` primed with the
  whole prompt (it looks at the prompt's tail only), reset on "Invalid prefix encountered"
  as vLLM does (vllm#17448).
* `SlowIncrementalDetokenizer`: vLLM's ``detokenize_incrementally`` (prefix/read
  offsets over vocabulary pieces), for tokenizers that DecodeStream does not serve
  (the ``transformers`` fallback, or a ``tokenizers`` release without DecodeStream).

Nothing here does I/O or imports an async library.
"""

from __future__ import annotations

import sys
from bisect import bisect_left
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..protocol import SamplingParams
    from ._tokenizer import Tokenizer

__all__ = [
    "FastIncrementalDetokenizer",
    "IncrementalDetokenizer",
    "SlowIncrementalDetokenizer",
    "check_stop_strings",
]

#: The start of the error tokenizers raises when DecodeStream's state broke (non-monotonic
#: or invalid UTF-8 output); vLLM resets the stream when it sees it.
INVALID_PREFIX_ERR_MSG: Final = "Invalid prefix encountered"
#: vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET (slow path).
_INITIAL_OFFSET: Final = 5


class IncrementalDetokenizer:
    """Token ids in, text out, for one completion; the no-detokenize base.

    This base keeps token ids only (``detokenize=False``: text stays ``""``).
    `for_request` picks the right subclass. Not thread-safe; never does I/O.
    """

    def __init__(self) -> None:
        self.token_ids: list[int] = []

    @property
    def output_token_ids(self) -> list[int]:
        """The generated token ids so far (trimmed after a stop string)."""
        return self.token_ids

    def num_output_tokens(self) -> int:
        """How many tokens were generated so far."""
        return len(self.token_ids)

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool) -> str | None:
        """Take one engine output's new tokens; return the stop string that matched, if any.

        ``stop_terminated``: the engine finished the request with ``FinishReason.STOP``
        (its last token is an EOS or stop token, which is not detokenized unless
        ``include_stop_str_in_output``).
        """
        self.token_ids.extend(new_token_ids)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to put in the next output: new text only with ``delta``."""
        return ""

    @property
    def output_text(self) -> str:
        """All the text so far (including the held-back tail)."""
        return ""

    @staticmethod
    def for_request(
        tokenizer: Tokenizer | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> IncrementalDetokenizer:
        """vLLM's ``IncrementalDetokenizer.from_new_request``: no text without a tokenizer or
        with ``detokenize=False``; DecodeStream for a fast tokenizer; else the slow path."""
        if tokenizer is None or not params.detokenize:
            return IncrementalDetokenizer()
        if tokenizer.is_fast and _decode_stream_class() is not None:
            return FastIncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        return SlowIncrementalDetokenizer(tokenizer, prompt_token_ids, params)


class _TextDetokenizer(IncrementalDetokenizer):
    """vLLM's ``BaseIncrementalDetokenizer``: text, stop strings and the hold-back buffer."""

    def __init__(self, params: SamplingParams) -> None:
        super().__init__()
        stop = params.stop
        self.stop: list[str] = [stop] if isinstance(stop, str) else list(stop or ())
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1
            if self.stop and not self.include_stop_str_in_output
            else 0
        )
        self._last_output_text_offset = 0
        self._text = ""

    @property
    def output_text(self) -> str:
        return self._text

    def decode_next(self, next_token_id: int) -> str:
        """The text that ``next_token_id`` adds (``""`` while a character is incomplete)."""
        raise NotImplementedError

    def _decode_tokens(self, new_token_ids: Sequence[int], offsets: list[int] | None) -> None:
        """Append the ids and their text; with ``offsets``, the text length after each."""
        token_ids = self.token_ids
        decode_next = self.decode_next
        # Drop our reference while appending: with the local as the only one, CPython
        # grows the string in place instead of copying the whole text per token.
        text, self._text = self._text, ""
        try:
            for token_id in new_token_ids:
                token_ids.append(token_id)
                text += decode_next(token_id)
                if offsets is not None:
                    offsets.append(len(text))
        finally:  # an error from the tokenizer must not lose the text
            self._text = text

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool) -> str | None:
        if not new_token_ids:
            return None
        skipped_stop_token_id: int | None = None
        if stop_terminated and not self.include_stop_str_in_output:
            # The EOS/stop token that ended the request is not part of the text.
            skipped_stop_token_id = new_token_ids[-1]
            new_token_ids = new_token_ids[:-1]
        token_ids = self.token_ids
        num_prev_tokens = self.num_output_tokens()
        first_new_token_index = len(token_ids)
        # Text offsets at the token boundaries, to trim tokens after a stop string.
        token_offsets = [len(self._text)] if self.stop else None
        self._decode_tokens(new_token_ids, token_offsets)
        if skipped_stop_token_id is not None:
            token_ids.append(skipped_stop_token_id)
            if token_offsets is not None:
                token_offsets.append(len(self._text))
        if token_offsets is None or self.num_output_tokens() <= self.min_tokens:
            return None
        return self._check_stop(token_offsets, num_prev_tokens, first_new_token_index)

    def _check_stop(
        self, token_offsets: list[int], num_prev_tokens: int, first_new_token_index: int
    ) -> str | None:
        """The stop-string step of `update` (past ``min_tokens``)."""
        text = self._text
        # Only text from tokens past min_tokens may hold a stop string (vllm#22014).
        stop_check_offset = token_offsets[max(self.min_tokens - num_prev_tokens, 0)]
        match = check_stop_strings(
            text, len(text) - stop_check_offset, self.stop, self.include_stop_str_in_output
        )
        if match is None:
            return None
        stop_string, truncate_to = match
        stop_end = len(text) if truncate_to == -1 else truncate_to
        if not self.include_stop_str_in_output:
            stop_end += len(stop_string)
        # Drop tokens generated after the one that completed the stop string (several
        # tokens can arrive in one step).
        num_kept = bisect_left(token_offsets, stop_end, lo=1)
        del self.token_ids[first_new_token_index + num_kept :]
        if truncate_to != -1:
            self._text = text[:truncate_to]
        return stop_string

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        buffer_length = 0 if finished else self.stop_buffer_length
        text = self._text
        if not delta:
            return text[:-buffer_length] if buffer_length else text
        length = len(text) - buffer_length
        last_offset = self._last_output_text_offset
        if last_offset < length:
            self._last_output_text_offset = length
            return text[last_offset:length]
        return ""


_DECODE_STREAM: list[Any] = []


def _decode_stream_class() -> Any:
    """``tokenizers.decoders.DecodeStream`` if it takes a prompt prefix (``ids=``), else
    ``None`` (tokenizers without it get the slow path)."""
    if not _DECODE_STREAM:
        try:
            from tokenizers.decoders import DecodeStream

            DecodeStream(ids=[], skip_special_tokens=False)
        except (ImportError, TypeError):  # tokenizers < 0.21, or without the prefix
            _DECODE_STREAM.append(None)
        else:
            _DECODE_STREAM.append(DecodeStream)
    return _DECODE_STREAM[0]


class FastIncrementalDetokenizer(_TextDetokenizer):
    """vLLM's ``FastIncrementalDetokenizer``: ``DecodeStream`` over the prompt's ids."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        super().__init__(params)
        assert tokenizer.backend is not None
        self._backend = tokenizer.backend
        self.skip_special_tokens = params.skip_special_tokens
        self._stream_class = _decode_stream_class()
        # Priming with the prompt makes the first generated token decode as it would
        # after the prompt (leading spaces, merges across the boundary).
        self._stream = self._stream_class(
            ids=list(prompt_token_ids), skip_special_tokens=self.skip_special_tokens
        )
        self._step = self._stream.step
        self.spaces_between_special_tokens = (
            params.skip_special_tokens or params.spaces_between_special_tokens
        )
        self._added_token_ids: dict[int, str] = {}
        self._last_special = False
        if not self.spaces_between_special_tokens:
            if tokenizer.added_tokens_decoder:
                self._added_token_ids = tokenizer.added_tokens_decoder
            else:
                self.spaces_between_special_tokens = True

    def _decode_tokens(self, new_token_ids: Sequence[int], offsets: list[int] | None) -> None:
        if not self.spaces_between_special_tokens:
            super()._decode_tokens(new_token_ids, offsets)
            return
        # The common case (plain spacing) inlined: the same result as decode_next per
        # token, fewer calls; the base class's update calls this once per step.
        append = self.token_ids.append
        backend = self._backend
        step = self._step
        text, self._text = self._text, ""
        try:
            for token_id in new_token_ids:
                append(token_id)
                try:
                    piece = step(backend, token_id)
                except Exception as exc:
                    piece = self._recover(token_id, exc)
                    step = self._step
                if piece:
                    text += piece
                if offsets is not None:
                    offsets.append(len(text))
        finally:  # an error from the tokenizer must not lose the text
            self._text = text

    def _recover(self, next_token_id: int, exc: Exception) -> str | None:
        if isinstance(exc, (OverflowError, TypeError)):
            # vLLM logs and emits nothing for such an id (vllm#21951).
            return None
        if not str(exc).startswith(INVALID_PREFIX_ERR_MSG):
            raise exc
        # The stream's state broke (non-monotonic UTF-8 output): start a fresh stream,
        # without the prompt, as vLLM does (vllm#17448).
        self._stream = self._stream_class(skip_special_tokens=self.skip_special_tokens)
        self._step = self._stream.step
        piece: str | None = self._step(self._backend, next_token_id)
        return piece

    def decode_next(self, next_token_id: int) -> str:
        try:
            token = self._step(self._backend, next_token_id)
        except Exception as exc:
            token = self._recover(next_token_id, exc)
        if not self.spaces_between_special_tokens:
            special_token = self._added_token_ids.get(next_token_id)
            is_special = special_token is not None
            if is_special and self._last_special:
                # Two added tokens in a row: the raw token, without the space before it.
                token = special_token
            self._last_special = is_special
        return token or ""


class SlowIncrementalDetokenizer(_TextDetokenizer):
    """vLLM's ``SlowIncrementalDetokenizer`` (``detokenize_incrementally`` over pieces)."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        super().__init__(params)
        self.tokenizer = tokenizer
        self.prompt_len = len(prompt_token_ids)
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        self.tokens, self.prefix_offset, self.read_offset = _convert_prompt_ids_to_tokens(
            tokenizer, prompt_token_ids, self.skip_special_tokens
        )
        self.token_ids.extend(prompt_token_ids)
        self._plain_join = tokenizer.joins_pieces_plainly

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :] if self.prompt_len else self.token_ids

    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def decode_next(self, next_token_id: int) -> str:
        tok = self.tokenizer
        if 0 <= next_token_id < len(tok):
            new_tokens = [
                t or ""
                for t in tok.convert_ids_to_tokens(
                    [next_token_id], skip_special_tokens=self.skip_special_tokens
                )
            ]
        else:
            new_tokens = [""]
        prev_tokens = self.tokens
        prefix_offset, read_offset = self.prefix_offset, self.read_offset
        output_token_count = len(prev_tokens) + len(new_tokens)
        window_start = min(prefix_offset, read_offset, len(prev_tokens))
        output_tokens = prev_tokens[window_start:] + new_tokens
        # The prefix text defeats decode clean-ups that add or drop a space depending on
        # the surrounding pieces.
        prefix = output_tokens[prefix_offset - window_start : read_offset - window_start]
        full = output_tokens[prefix_offset - window_start :]
        if self._plain_join:
            prefix_text = tok.convert_tokens_to_string(prefix)
            new_text = tok.convert_tokens_to_string(full)
        else:
            prefix_text = self._join_with_added(prefix)
            new_text = self._join_with_added(full)
        self.tokens.extend(new_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            # An unfinished UTF-8 sequence (byte fallback) at the end: wait for more.
            return ""
        self.prefix_offset, self.read_offset = read_offset, output_token_count
        return new_text[len(prefix_text) :]

    def _join_with_added(self, output_tokens: list[str]) -> str:
        # vLLM's _convert_tokens_to_string_with_added_encoders (slow tokenizers only).
        tok = self.tokenizer
        added = set(tok.added_vocab())
        special = set(tok.all_special_tokens) if self.skip_special_tokens else set()
        sub_texts: list[str] = []
        current: list[str] = []
        for token in output_tokens:
            if token in special:
                continue
            if token in added:
                if current:
                    sub_texts.append(tok.convert_tokens_to_string(current))
                    current = []
                sub_texts.append(token)
            else:
                current.append(token)
        if current:
            sub_texts.append(tok.convert_tokens_to_string(current))
        return (" " if self.spaces_between_special_tokens else "").join(sub_texts)


def _convert_prompt_ids_to_tokens(
    tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool
) -> tuple[list[str], int, int]:
    # Only the prompt's tail matters; a little more in case of special tokens.
    new_tokens = tokenizer.convert_ids_to_tokens(
        list(prompt_ids[-_INITIAL_OFFSET - 2 :]), skip_special_tokens=skip_special_tokens
    )
    read_offset = len(new_tokens)
    prefix_offset = max(read_offset - _INITIAL_OFFSET, 0)
    return [t or "" for t in new_tokens], prefix_offset, read_offset


def check_stop_strings(
    output_text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """vLLM's ``check_stop_strings``: find a stop string in the newest text.

    Searches only where a match could end in the last ``new_char_count`` characters.
    Returns ``(stop_string, truncate_to)`` where ``truncate_to`` is the length to cut the
    text to (``-1``: keep it all), or ``None``. Of several matches the one that completes
    earliest wins; ties go to the first in ``stop``.
    """
    if not new_char_count or not stop:
        return None
    best_stop_str: str | None = None
    best_stop_index = 0
    best_end = sys.maxsize
    for stop_str in stop:
        stop_string_len = len(stop_str)
        stop_index = output_text.find(stop_str, 1 - new_char_count - stop_string_len)
        if stop_index == -1:
            continue
        end = stop_index + stop_string_len
        if end < best_end:
            best_stop_str, best_stop_index, best_end = stop_str, stop_index, end
    if best_stop_str is None:
        return None
    if include_in_output:
        if best_end >= len(output_text):
            return best_stop_str, -1
        return best_stop_str, best_end
    return best_stop_str, best_stop_index
