"""platform/request_limits.py: a request's max_tokens against the context in each of the
three fits, its worst case against the KV cache and the tenant's budget."""

from __future__ import annotations

import pytest

from loraplex.platform.request import SamplingParams
from loraplex.platform.request_limits import EngineLimits, fit_request

LIMITS = EngineLimits(max_model_len=64, num_blocks=16, block_size=8)


def test_a_prompt_must_leave_room_for_one_token():
    with pytest.raises(ValueError, match="prompt has 64 tokens, but max_model_len is 64"):
        fit_request(64, SamplingParams(max_tokens=1), LIMITS)
    assert fit_request(63, SamplingParams(max_tokens=1), LIMITS).worst_case_tokens == 64


@pytest.mark.parametrize(
    ("fit", "max_tokens"),
    [("requested", None), ("default", 24), ("up_to_context", 30)],
)
def test_max_tokens_past_the_context(fit, max_tokens):
    """40 prompt tokens leave 24: a requested 30 is refused, a default one shortened, and
    the offline engine keeps it (generation stops at the context's end)."""
    params = SamplingParams(max_tokens=30)
    if max_tokens is None:
        with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
            fit_request(40, params, LIMITS, fit)
        return
    fitted = fit_request(40, params, LIMITS, fit)
    assert fitted.params.max_tokens == max_tokens
    assert fitted.worst_case_tokens == 40 + max_tokens


def test_the_kv_cache_must_hold_every_completion_at_full_length():
    """Prompt 20 tokens (2 full blocks shared), each completion up to 40 tokens: 5 blocks,
    3 of them its own. n = 4 needs 2 + 4 x 3 = 14 of 16 blocks; n = 5 needs 17."""
    assert fit_request(20, SamplingParams(max_tokens=20, n=4), LIMITS).worst_case_tokens == 100
    with pytest.raises(ValueError, match="needs up to 17 KV cache blocks"):
        fit_request(20, SamplingParams(max_tokens=20, n=5), LIMITS)


def test_the_worst_case_must_fit_the_tenants_budget():
    params = SamplingParams(max_tokens=10, n=2)
    assert fit_request(5, params, LIMITS, token_budget=25).worst_case_tokens == 25
    with pytest.raises(ValueError, match="up to 25 tokens .* budget of 24"):
        fit_request(5, params, LIMITS, token_budget=24)
