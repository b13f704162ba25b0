"""Incremental detokenization and stop strings for streaming.

New ids are decoded inside a short window that starts with the ids of the previous
released text, and that text is cut off the front (the prefix-offset / read-offset
technique), so each call costs O(new tokens) and tokenizers whose decoding depends on
the previous token (leading spaces, bytes merged across tokens) read as a full decode:

    window: | p p p | o o o |      prefix text = decode(p p p)
            ^0      ^read          new text    = decode(window)[len(prefix text):]

When the new text settles (below), the open ids become the next window's prefix.

A window whose text ends in U+FFFD is (usually) a multi-byte character whose remaining
bytes are still to come: that trailing run is held back and the window stays open
until it resolves. Text is decoded with `clean_up_tokenization_spaces=False`, the only
setting under which a windowed decode can agree with a full one.

Stop strings: text is cut before the first stop string (after it with
`include_stop_str_in_output`) and `finished_by_stop` names it. Before `min_tokens`
tokens were generated, text is not searched (a stop string that ends in a later token
is still found). While the request runs,
a tail of text that could still grow into a stop string is held back from `text`;
`full_text` also has that tail (and any unfinished character), for when the request
ends some other way.
"""

from __future__ import annotations

import logging

from loraplex.platform.request import SamplingParams
from loraplex.platform.tokenizer import text_decoder

logger = logging.getLogger(__name__)

CONTEXT_TOKENS = 5
"""Prompt tokens decoded in front of the first output token, so its leading space shows."""

MAX_OPEN_TOKENS = 16
"""A window whose settled text has not grown for this many tokens while it ends in
U+FFFD holds invalid bytes, not a character in flight: its text is released as is and
the window moves on. (Counting open tokens instead would misfire when every append
completes one character and starts the next: the window then never closes, yet each
character is valid.)"""

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated ids into streamable text, watching for stop strings."""

    def __init__(
        self, tokenizer: object, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._decode_ids = text_decoder(tokenizer)
        self._skip_special = params.skip_special_tokens
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._generated = 0
        self._longest_stop = max((len(stop) for stop in self._stops), default=0)
        self._ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        """The window: ids already turned into text, then the open ones."""
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._window_taken = 0
        """Characters past the prefix text of the open window already in `_decoded`."""
        self._stalled = 0
        """Tokens appended since the settled text last grew (or the window moved)."""
        self._decoded = ""
        """Output text made of settled characters, cut at a stop string."""
        self._unsettled = ""
        """The window's trailing U+FFFD run: a character whose bytes are still coming."""
        self._scanned = 0
        self._released = 0
        self.finished_by_stop: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self._skip_special)

    def append(self, new_token_ids: list[int]) -> str:
        """Adds generated ids; returns the text newly released to `text` (maybe "").

        Ids that arrive after a stop string was found are ignored.
        """
        if self.finished_by_stop is None and new_token_ids:
            self._ids.extend(new_token_ids)
            self._generated += len(new_token_ids)
            self._stalled += len(new_token_ids)
            self._decode_window()
            self._check_stop()
        end = len(self._decoded) - self._held_back()
        delta = self._decoded[self._released : end] if end > self._released else ""
        self._released = max(self._released, end)
        return delta

    def _decode_window(self) -> None:
        window = self._decode(self._ids)
        start = len(self._prefix_text) + self._window_taken
        settled_end = len(window.rstrip(REPLACEMENT))
        overdue = self._stalled > MAX_OPEN_TOKENS
        if overdue and settled_end < len(window):
            logger.debug("releasing undecodable bytes as U+FFFD")
            settled_end = len(window)
        if settled_end > start:
            self._decoded += window[start:settled_end]
            self._window_taken = settled_end - len(self._prefix_text)
            self._stalled = 0
        self._unsettled = window[max(start, settled_end) :]
        if not self._unsettled and (overdue or len(window) > len(self._prefix_text)):
            del self._ids[: self._read_offset]
            self._read_offset = len(self._ids)
            self._prefix_text = self._decode(self._ids)
            self._window_taken = 0
            self._stalled = 0

    def _check_stop(self) -> None:
        if not self._stops:
            return
        if self._generated < self._min_tokens:
            self._scanned = len(self._decoded)
            return
        start = max(0, self._scanned - self._longest_stop + 1)
        self._scanned = len(self._decoded)
        hits = [(self._decoded.find(stop, start), stop) for stop in self._stops]
        hits = [(index, stop) for index, stop in hits if index >= 0]
        if not hits:
            return
        index, stop = min(hits, key=lambda hit: hit[0])
        self._decoded = self._decoded[: index + len(stop) if self._include_stop else index]
        self._unsettled = ""
        self.finished_by_stop = stop

    def _held_back(self) -> int:
        """Length of the longest unreleased suffix that is a proper prefix of a stop."""
        if self.finished_by_stop is not None or not self._stops:
            return 0
        longest = min(self._longest_stop - 1, len(self._decoded) - self._released)
        for size in range(longest, 0, -1):
            suffix = self._decoded[-size:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return size
        return 0

    @property
    def text(self) -> str:
        """Text safe to stream: grows monotonically; everything `append` returned."""
        if self._released == len(self._decoded):
            return self._decoded
        return self._decoded[: self._released]

    @property
    def full_text(self) -> str:
        """All output text, cut at a stop string if one appeared: the final text of a
        request that ended by length, EOS or abort."""
        return self._decoded + self._unsettled
