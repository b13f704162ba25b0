"""Hypothesis strategies shared by the fuzz tests (engine level and over HTTP): every
request field across its whole range, valid values drawn often enough to be served."""

from __future__ import annotations

from hypothesis import strategies as st

ANY_NUMBER = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 512, 513, 2**31, 2**63, 2**64, 1e-300, 1e308]),
)
"""Any JSON number: huge and negative integers, NaN, +-Infinity, edges."""

SAMPLING_FIELDS = {
    "max_tokens": st.one_of(st.integers(1, 5), ANY_NUMBER, st.none()),
    "temperature": st.one_of(st.floats(0, 2), ANY_NUMBER),
    "top_p": st.one_of(st.floats(0, 1), ANY_NUMBER),
    "top_k": st.one_of(st.integers(-2, 600), ANY_NUMBER),
    "min_p": st.one_of(st.floats(0, 1), ANY_NUMBER),
    "n": st.one_of(st.integers(1, 3), ANY_NUMBER),
    "seed": st.one_of(st.none(), ANY_NUMBER),
    "presence_penalty": st.one_of(st.floats(-2, 2), ANY_NUMBER),
    "frequency_penalty": st.one_of(st.floats(-2, 2), ANY_NUMBER),
    "repetition_penalty": st.one_of(st.floats(0.1, 10), ANY_NUMBER),
    "logprobs": st.one_of(st.none(), st.integers(0, 5), ANY_NUMBER),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 3), ANY_NUMBER),
    "echo": st.one_of(st.booleans(), st.none()),
    "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5)),
    "prompt": st.one_of(
        st.text(max_size=20),
        st.lists(st.integers(-3, 600), max_size=12),
        st.lists(st.sampled_from([2**63, 2**64, -(2**63), 10**30]), min_size=1, max_size=2),
    ),
}
"""/v1/completions sampling fields (optional keys of a body whose model is fixed)."""

COMPLETION_BODY = st.fixed_dictionaries({"model": st.just("tiny")}, optional=SAMPLING_FIELDS)
