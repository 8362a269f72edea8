"""Incremental detokenization and stop strings, in the front end.

Text is decoded over a sliding window of tokens so each step costs the same however long
the output grows; a window whose text ends in U+FFFD (an incomplete UTF-8 sequence) waits
for the next token. Stop strings are searched in the text as it grows; while a request
runs, the last `len(longest stop) - 1` characters are held back, so a stop string that
arrives split across tokens is never partly streamed.
"""

from __future__ import annotations

from typing import Protocol

from gateway.sampling_params import SamplingParams

# Prompt tokens kept as context for the first window (spacing of the first output token).
_NUM_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        # With fast (`tokenizers`) decoders special tokens are joined as the decoder
        # writes them, so spaces_between_special_tokens changes nothing (as in vLLM's
        # fast incremental detokenizer).
        self.skip_special_tokens = params.skip_special_tokens
        self.hold_back = max((len(s) for s in self.stop_strings), default=1) - 1
        self.output_text = ""
        self.num_sent_chars = 0
        self._window = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._window)
        #: After `update` found a stop string: how many of its tokens the output keeps
        #: (several tokens come at once with speculative decoding; those after the stop
        #: string's are dropped, as if generated one at a time).
        self.num_stop_tokens = 0

    def update(self, new_token_ids: list[int], skip_last: bool = False) -> str | None:
        """Decode new tokens; return the stop string that ended the output, if one did.

        `skip_last`: the last token is a stop token or EOS, whose text is not output.
        """
        count = len(new_token_ids) - (1 if skip_last else 0)
        for index, token_id in enumerate(new_token_ids[:count]):
            start = max(0, len(self.output_text) - self.hold_back)
            self.output_text += self._decode_next(token_id)
            stop = self._find_stop(start)
            if stop is not None:
                self.num_stop_tokens = index + 1
                return stop
        return None

    def _decode_next(self, token_id: int) -> str:
        self._window.append(token_id)
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(self._window[self._prefix_offset:self._read_offset],
                                       skip_special_tokens=skip)
        full = self.tokenizer.decode(self._window[self._prefix_offset:],
                                     skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # wait for the rest of a multi-byte character
        self._prefix_offset, self._read_offset = self._read_offset, len(self._window)
        if self._prefix_offset > 64:  # keep the window short
            del self._window[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return full[len(prefix):]

    def _find_stop(self, start: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            index = self.output_text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        end = best[0] + len(best[1]) if self.include_stop else best[0]
        self.output_text = self.output_text[:end]
        return best[1]

    def take_delta(self, finished: bool) -> str:
        """Text not yet sent: everything when finished, else all but the held-back tail."""
        end = len(self.output_text) if finished else max(
            self.num_sent_chars, len(self.output_text) - self.hold_back)
        delta = self.output_text[self.num_sent_chars:end]
        self.num_sent_chars = end
        return delta
