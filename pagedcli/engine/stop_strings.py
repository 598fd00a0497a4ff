"""Stop strings: a request ends as soon as its text contains one, and its text ends before it
(vLLM's meaning; the token that completed it stays in the token ids).

The engine does not know the tokenizer: it is given a `detokenizer` (engine/build.py's: a StreamDecoder
over the model's tokenizer) and makes one per request that has stop strings. Each step decodes
only the new tokens, and only the new text and the len(stop) - 1 characters before it are
searched, as vLLM does: the host's work per step does not grow with the answer.
"""

from __future__ import annotations

from typing import Callable, Protocol


class Detokenizer(Protocol):
    text: str

    def catch_up(self, output_ids: list[int]) -> str: ...


MakeDetokenizer = Callable[[list[int]], Detokenizer]  # a request's prompt ids -> its incremental detokenizer


class StopStrings:
    def __init__(self, stops: tuple[str, ...], detokenizer: Detokenizer):
        self.stops = stops
        self.detokenizer = detokenizer
        self.hold = max(len(s) for s in stops) - 1  # a tail that may be the start of a stop string
        self.cut: int | None = None  # where the text ends, once a stop string is found

    def update(self, output_ids: list[int]) -> bool:
        """Take in the new output tokens; whether the text now holds a stop string."""
        if self.cut is not None:
            return True
        before = len(self.detokenizer.text)
        if not self.detokenizer.catch_up(output_ids):
            return False
        text, start = self.detokenizer.text, max(0, before - self.hold)
        found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.cut = min(found)
        return self.cut is not None

    def text(self, finished: bool) -> str:
        """The text to show: cut before the stop string; while the request runs, without the tail
        that a stop string may yet start with (so that nothing shown is taken back)."""
        return self.text_since(0, finished)

    def text_since(self, start: int, finished: bool) -> str:
        """text(finished)[start:], copying only that: a printer or the server, which have shown the
        first `start` characters, take each step's new text without a copy of the whole answer."""
        return self.detokenizer.text[start:self.shown(finished)]

    def shown(self, finished: bool) -> int:
        """How many characters of the text may be shown (text(finished)'s length)."""
        if self.cut is not None:
            return self.cut
        length = len(self.detokenizer.text)
        return length if finished else max(0, length - self.hold)
