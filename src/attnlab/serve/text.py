"""Token ids → the text a client sees: held back while it ends inside a multi-byte character or
could be the start of a stop string, cut at the first stop string."""

from __future__ import annotations


class TextTracker:
    def __init__(self, model, prompt_ids: list[int], stops: list[str]):
        self.model, self.prompt, self.stops = model, list(prompt_ids), stops
        self.ids: list[int] = []
        self.text = ""
        self.shown = ""

    def add(self, token: int) -> tuple[str, bool]:
        """A new token → (text to show now, whether a stop string was reached)."""
        self.ids.append(token)
        self.text = self.model.continuation(self.prompt, self.ids)
        if self.stops:
            hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
            if hits:
                return self._show(self.text[: min(hits)]), True
        safe = self.text
        if safe.endswith("\ufffd"):
            return "", False
        hold = max((n for s in self.stops for n in range(1, len(s)) if safe.endswith(s[:n])), default=0)
        return self._show(safe[: len(safe) - hold]), False

    def flush(self) -> str:
        """Generation ended: the rest of the text (no stop string was in it)."""
        return self._show(self.text)

    def _show(self, text: str) -> str:
        if len(text) <= len(self.shown) or not text.startswith(self.shown):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece
