"""The two front stages of vLLM 0.32's parser engine (``vllm/parser/engine``), for
literal terminals: ``TokenIDScanner`` (marker token ids split a delta before any text
matching) and ``IncrementalLexer`` (text into terminals, holding back a suffix that may
still become one). Ported for the ``qwen3`` reasoning parser; token counts are left out
(nothing here reports them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

__all__ = ["CONTENT", "LiteralLexer", "MarkerScanner", "Piece"]

#: The terminal name of plain text.
CONTENT = "__CONTENT__"


class Piece(NamedTuple):
    """A lexed piece of text: ``terminal`` is `CONTENT` or a literal's name; ``by_id``
    says it came from a marker token id (the scanner), not from matching text."""

    terminal: str
    text: str
    by_id: bool = False


class LiteralLexer:
    """vLLM's ``IncrementalLexer`` for literal-only terminals."""

    def __init__(self, literals: Mapping[str, str]) -> None:
        # name -> literal; matching prefers the longest literal.
        self._by_first: dict[str, list[tuple[str, str]]] = {}
        for name, lit in literals.items():
            self._by_first.setdefault(lit[0], []).append((lit, name))
        self._literals = [(lit, name) for name, lit in literals.items()]
        self._first_chars = frozenset(self._by_first)
        self._prefixes = frozenset(lit[:i] for lit in literals.values() for i in range(1, len(lit)))
        self.buffer = ""

    def reset(self) -> None:
        self.buffer = ""

    def could_start_terminal(self, text: str) -> bool:
        return not self._first_chars.isdisjoint(text)

    def feed(self, text: str) -> list[Piece]:
        if not self.buffer and not self.could_start_terminal(text):
            return [Piece(CONTENT, text)]
        self.buffer += text
        return self._drain(final=False)

    def flush(self) -> list[Piece]:
        pieces = self._drain(final=True) if self.buffer else []
        if self.buffer:
            pieces.append(Piece(CONTENT, self.buffer))
            self.buffer = ""
        return pieces

    def _drain(self, *, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while self.buffer:
            buf = self.buffer
            if not self.could_start_terminal(buf):
                pieces.append(Piece(CONTENT, buf))
                self.buffer = ""
                break
            candidates = self._by_first.get(buf[0], [])
            best: tuple[str, str] | None = None
            for lit, name in candidates:
                if buf.startswith(lit) and (best is None or len(lit) > len(best[0])):
                    best = (lit, name)
            # The whole buffer may still grow into a (longer) literal: hold it.
            if (
                buf in self._prefixes
                and not final
                and (
                    best is None
                    or any(len(lit) > len(best[0]) and lit.startswith(buf) for lit, _ in candidates)
                )
            ):
                break
            if best is not None:
                pieces.append(Piece(best[1], best[0]))
                self.buffer = buf[len(best[0]) :]
                continue
            end = self._content_boundary(buf)
            end = end if end > 0 else 1
            pieces.append(Piece(CONTENT, buf[:end]))
            self.buffer = buf[end:]
        return pieces

    def _content_boundary(self, buf: str) -> int:
        """Where a literal (or a prefix of one, at the end) may start after position 0."""
        for i in range(1, len(buf)):
            if buf[i] not in self._first_chars:
                continue
            for lit, _ in self._literals:
                n = min(len(buf) - i, len(lit))
                if buf[i : i + n] == lit[:n]:
                    return i
        return len(buf)


class _Marker(NamedTuple):
    terminal: str
    text: str


class MarkerScanner:
    """vLLM's ``TokenIDScanner``: marker token ids become terminals whatever the text
    around them; a marker whose text the detokenizer has not released yet waits for
    a later delta."""

    def __init__(self, markers: Mapping[int, str], decode: Callable[[int], str]) -> None:
        self._markers = dict(markers)
        self._decode = decode
        self._cache: dict[int, str] = {}
        self._deferred: list[_Marker] = []
        self._deferred_post_text = ""

    def reset(self) -> None:
        self._deferred.clear()
        self._deferred_post_text = ""

    @property
    def has_deferred(self) -> bool:
        return bool(self._deferred)

    def has_marker(self, token_ids: Sequence[int]) -> bool:
        return any(tid in self._markers for tid in token_ids)

    def _text(self, token_id: int) -> str:
        if token_id not in self._cache:
            self._cache[token_id] = self._decode(token_id)
        return self._cache[token_id]

    def scan(self, delta_text: str, token_ids: Sequence[int]) -> list[Piece | _Marker]:
        prefix: list[Piece | _Marker] = []
        text = delta_text
        if self._deferred:
            prefix, text = self._resolve_deferred(delta_text)
        if not self.has_marker(token_ids):
            return [*prefix, Piece(CONTENT, text)] if text else prefix
        results: list[Piece | _Marker] = []
        plain: list[str] = []
        for tid in token_ids:
            terminal = self._markers.get(tid)
            if terminal is None:
                plain.append(self._text(tid))
                continue
            if "".join(plain):
                results.append(Piece(CONTENT, "".join(plain)))
            plain.clear()
            results.append(_Marker(terminal, self._text(tid)))
        if "".join(plain):
            results.append(Piece(CONTENT, "".join(plain)))
        if text:
            results = self._recover_holdback(text, results)
        else:
            self._deferred.extend(r for r in results if isinstance(r, _Marker))
            results = []
        return prefix + results

    def flush_pending(self) -> list[Piece | _Marker]:
        results: list[Piece | _Marker] = []
        if self._deferred_post_text:
            results.append(Piece(CONTENT, self._deferred_post_text))
            self._deferred_post_text = ""
        results.extend(self._deferred)
        self._deferred.clear()
        return results

    def _resolve_deferred(self, delta_text: str) -> tuple[list[Piece | _Marker], str]:
        deferred, self._deferred = self._deferred, []
        results: list[Piece | _Marker] = []
        remaining = self._deferred_post_text + delta_text
        self._deferred_post_text = ""
        for marker in deferred:
            pos = remaining.find(marker.text)
            if pos >= 0:
                if pos > 0:
                    results.append(Piece(CONTENT, remaining[:pos]))
                results.append(marker)
                remaining = remaining[pos + len(marker.text) :]
            else:
                if remaining:
                    self._deferred_post_text += remaining
                    remaining = ""
                self._deferred.append(marker)
        return results, remaining

    def _recover_holdback(
        self, delta_text: str, results: list[Piece | _Marker]
    ) -> list[Piece | _Marker]:
        """Text the detokenizer released late leads the delta: keep it in front."""
        if not results:
            return [Piece(CONTENT, delta_text)]
        rebuilt = "".join(r.text for r in results)
        if not rebuilt:
            return [Piece(CONTENT, delta_text), *results]
        pos = delta_text.find(rebuilt)
        if pos > 0:
            return [Piece(CONTENT, delta_text[:pos]), *results]
        if pos == 0:
            return results
        return self._rebuild_from_anchors(delta_text, results)

    def _rebuild_from_anchors(
        self, delta_text: str, results: list[Piece | _Marker]
    ) -> list[Piece | _Marker]:
        """Split ``delta_text`` at the markers, found right to left (vLLM's rule: a
        marker binds to its rightmost occurrence); a marker not found waits."""
        anchors = [r for r in results if isinstance(r, _Marker)]
        if not anchors:
            return [Piece(CONTENT, delta_text)]
        positions = [-1] * len(anchors)
        search_end = len(delta_text)
        for i in range(len(anchors) - 1, -1, -1):
            pos = delta_text.rfind(anchors[i].text, 0, search_end)
            if pos >= 0:
                positions[i] = pos
                search_end = pos
        rebuilt: list[Piece | _Marker] = []
        consumed = 0
        for i, anchor in enumerate(anchors):
            pos = positions[i]
            if pos >= consumed:
                if pos > consumed:
                    rebuilt.append(Piece(CONTENT, delta_text[consumed:pos]))
                rebuilt.append(anchor)
                consumed = pos + len(anchor.text)
            else:
                if not any(p >= 0 for p in positions[i + 1 :]) and consumed < len(delta_text):
                    self._deferred_post_text += delta_text[consumed:]
                    consumed = len(delta_text)
                self._deferred.append(anchor)
        if consumed < len(delta_text):
            rebuilt.append(Piece(CONTENT, delta_text[consumed:]))
        return rebuilt
