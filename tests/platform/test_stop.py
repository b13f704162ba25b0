"""The stop rule (platform/stop.py), on requests built by hand: which condition ends a
request after its newest token, in which order, and with which stop_reason."""

import pytest

from loraplex.platform.request import Request, RequestStatus, SamplingParams
from loraplex.platform.stop import Stop, check_stop

EOS = 2
MAX_LEN = 32


def request_with(outputs: list[int], prompt_len: int = 4, **params) -> Request:
    request = Request(
        "r", list(range(10, 10 + prompt_len)), SamplingParams(**params), frozenset({EOS})
    )
    for token in outputs:
        request.append_output_token(token, None)
    return request


def test_a_request_with_no_stop_condition_runs_on():
    request = request_with([5, 6], max_tokens=8, stop_token_ids=[7])
    assert check_stop(request, MAX_LEN) is None
    assert request.status is RequestStatus.WAITING and request.stop_reason is None


def test_eos_stops_with_no_reason_unless_ignored():
    assert check_stop(request_with([5, EOS]), MAX_LEN) == Stop(RequestStatus.FINISHED_STOPPED)
    assert check_stop(request_with([5, EOS], ignore_eos=True), MAX_LEN) is None


def test_a_stop_token_stops_with_its_id_even_when_eos_is_ignored():
    request = request_with([5, 7], stop_token_ids=[7], ignore_eos=True)
    assert check_stop(request, MAX_LEN) == Stop(RequestStatus.FINISHED_STOPPED, 7)
    assert check_stop(request_with([EOS], stop_token_ids=[EOS]), MAX_LEN) == Stop(
        RequestStatus.FINISHED_STOPPED
    )


def test_max_tokens_and_max_model_len_end_by_length():
    assert check_stop(request_with([5, 6], max_tokens=2), MAX_LEN) == Stop(
        RequestStatus.FINISHED_LENGTH
    )
    full = request_with([5, 6], prompt_len=MAX_LEN - 2, max_tokens=100)
    assert check_stop(full, MAX_LEN) == Stop(RequestStatus.FINISHED_LENGTH)
    assert check_stop(full, MAX_LEN + 1) is None


@pytest.mark.parametrize(
    "outputs, params",
    [([5], {}), ([EOS], {}), ([7], {"stop_token_ids": [7]}), ([5], {"max_tokens": 1})],
    ids=["running", "eos", "stop-token", "length"],
)
def test_a_stop_string_wins_over_every_other_condition(outputs, params):
    request = request_with(outputs, **params)
    assert check_stop(request, MAX_LEN, stop_string="END") == Stop(
        RequestStatus.FINISHED_STOPPED, "END"
    )
