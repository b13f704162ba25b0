"""The stop rule: whether a request ends after its newest token, and why.

The one place that decides it. The engine asks after every step, once the scheduler
has appended the sampled tokens and the output processor has looked for stop strings
in the new text; it then ends the request through the scheduler (which frees its
blocks at once). In order, the first that holds wins:

    stop string      the detokenized text contains one of `stop`   stop, the string
    grammar ended    a guided request's grammar is complete and    stop, None
                     the model ended it (or it can only end)
    end of sequence  the token is an EOS id and not `ignore_eos`   stop, None
    stop token       the token is in `stop_token_ids`              stop, the token id
    max_tokens       the request generated `max_tokens` tokens     length, None
    max_model_len    prompt + generated tokens fill the model      length, None
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.platform.request import Request, RequestStatus


@dataclass(frozen=True)
class Stop:
    """Why a request ended: its finished `status` (stop or length) and the
    `stop_reason` its output reports (the stop string or token id; None otherwise)."""

    status: RequestStatus
    reason: int | str | None = None


def check_stop(request: Request, max_model_len: int, stop_string: str | None = None) -> Stop | None:
    """The Stop that ends `request` now that its last output token was appended, or None
    when it runs on. `stop_string` is the stop string the request's detokenizer found
    in its text (None: none found). Reads the request only; changes nothing."""
    if stop_string is not None:
        return Stop(RequestStatus.FINISHED_STOPPED, stop_string)
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.grammar is not None and request.grammar.is_terminated():
        return Stop(RequestStatus.FINISHED_STOPPED)
    if not params.ignore_eos and last in request.eos_token_ids:
        return Stop(RequestStatus.FINISHED_STOPPED)
    if last in params.stop_token_ids:
        return Stop(RequestStatus.FINISHED_STOPPED, last)
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return Stop(RequestStatus.FINISHED_LENGTH)
    return None
