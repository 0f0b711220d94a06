"""Stop strings over streamed text: emit what is safe, hold back what could begin a stop string.

Text arrives in pieces (one per token); a stop string may span pieces. The matcher keeps back the longest
tail of the text seen so far that is a proper prefix of some stop string, so no part of a stop string is
ever sent to the client before the match is known. When several stop strings occur, the one that
*ends* first wins (that is where a character-by-character generation would have stopped); on a tie the
one that starts first (the longer one) wins.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text pieces; get back the text that is safe to emit and the stop string once one matches."""

    def __init__(self, stops: Sequence[str], include_stop_string: bool = False) -> None:
        assert all(stops), "stop strings must be non-empty"
        self._stops = tuple(stops)
        self._include = include_stop_string
        self._held = ""  # invariant: the longest tail of the text so far that is a proper prefix of a stop
        self.matched: str | None = None

    @property
    def held_text(self) -> str:
        return self._held

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add ``text``; return ``(text to emit now, the stop string that matched or None)``.

        After a match the emitted text ends where the stop string starts (or, with
        ``include_stop_string``, where it ends); the matcher must not be fed again.
        """
        assert self.matched is None, "feed() after a stop string matched"
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self.matched, self._held = stop, ""
            return buffer[: start + len(stop) if self._include else start], stop
        # A match can only start inside the held tail or the new text: every earlier position was
        # released because the text from it on had already diverged from every stop string.
        hold = self._hold_length(buffer)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], None

    def flush(self) -> str:
        """The generation ended without a match: release the held-back tail."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buffer.find(stop)  # the earliest start of one string is also its earliest end
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _hold_length(self, buffer: str) -> int:
        """Length of the longest tail of ``buffer`` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            # Only positions holding the stop's first character can start it; scanning left to right
            # finds the longest tail first.
            pos = buffer.find(stop[0], max(0, len(buffer) - len(stop) + 1))
            while pos != -1 and len(buffer) - pos > best:
                if stop.startswith(buffer[pos:]):
                    best = len(buffer) - pos
                    break
                pos = buffer.find(stop[0], pos + 1)
        return best
