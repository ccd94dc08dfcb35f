"""One generation as text: tokens in, text out as it becomes final, cut at the first stop
string (what `moeforge run` prints and `moeforge serve` streams)."""
from __future__ import annotations

import time


class Generation:
    """run(on_text) hands out the text as it becomes final: decoded incrementally
    (Tokenizer.stream), and held back while it could still begin a stop string. eos: stop
    at the model's end-of-generation tokens."""

    def __init__(self, model, ids: list[int], max_tokens: int, sampling=None, stop=(), eos: bool = True):
        self.model, self.ids, self.max_tokens, self.sampling = model, ids, max_tokens, sampling
        self.stop, self.eos = list(stop), eos
        self.tokens: list[int] = []
        self.text, self.sent, self.finish = "", 0, "length"
        self.first_token_at: float | None = None     # perf_counter: the prompt pass ends here
        self._stream = model.tokenizer.stream()

    def _on_token(self, t: int) -> bool:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens.append(t)
        before = len(self.text)
        self.text += self._stream.add(t)
        # a stop string can only end in the new text
        hits = [i for i in (self.text.find(s, max(0, before - len(s) + 1)) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.finish = self.text[:min(hits)], "stop"
            return True
        return False

    def run(self, on_text=None) -> None:
        """on_text(piece) gets the text as it becomes final; a true return ends the
        generation (the client went away)."""
        def step(t):
            done = self._on_token(t)
            if on_text is not None:
                final = len(self.text) if done else self._final_length()
                if final > self.sent:
                    gone = on_text(self.text[self.sent:final])
                    self.sent = final
                    return done or bool(gone)
            return done
        out = self.model.generate(self.ids, self.max_tokens, self.sampling,
                                  stop=self.model.eos_ids if self.eos else (), on_token=step)
        if self.finish == "length":
            self.text += self._stream.flush()
            if len(out) < self.max_tokens:
                self.finish = "stop"          # the end-of-turn token
        if on_text is not None and len(self.text) > self.sent:
            on_text(self.text[self.sent:])
            self.sent = len(self.text)

    def _final_length(self) -> int:
        """Text that no stop string can still claim."""
        end = len(self.text)
        for s in self.stop:
            for k in range(min(len(s) - 1, end), 0, -1):
                if self.text[:end].endswith(s[:k]):
                    end -= k
                    break
        return max(end, self.sent)
