"""A request's outputs by `output_kind`: a DELTA request's outputs, joined in order
(`merge_outputs`), equal the last output of the same CUMULATIVE request run beside it
(text, token ids, logprobs, finish, prompt logprobs), and each lists only what is new."""

from __future__ import annotations

import pytest

from loraplex.platform import LLM, SamplingParams
from loraplex.platform.request import CUMULATIVE, DELTA, RequestOutput, merge_outputs


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(str(tiny_model_factory("llama")), max_model_len=64, dtype="float32")


def _run_side_by_side(llm, prompt, params) -> tuple[list[RequestOutput], list[RequestOutput]]:
    engine = llm.engine
    engine.add_request("whole", prompt, params)
    engine.add_request("delta", prompt, SamplingParams(**{**vars(params), "output_kind": DELTA}))
    outputs: dict[str, list[RequestOutput]] = {"whole": [], "delta": []}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return outputs["whole"], outputs["delta"]


def _stop_word(llm, prompt) -> str:
    (free,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))
    return free.text.split()[2]


@pytest.mark.parametrize("case", ["stop string, logprobs", "n=3 sampled", "ends by length"])
def test_deltas_joined_equal_the_cumulative_output(llm, case):
    prompt = list(range(30, 50))
    params = {
        "stop string, logprobs": SamplingParams(
            temperature=0,
            max_tokens=10,
            stop=[_stop_word(llm, prompt)],
            logprobs=2,
            prompt_logprobs=1,
        ),
        "n=3 sampled": SamplingParams(
            n=3, temperature=1.0, seed=11, max_tokens=9, logprobs=1, ignore_eos=True
        ),
        "ends by length": SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    }[case]
    whole, deltas = _run_side_by_side(llm, prompt, params)
    joined = deltas[0]
    for delta in deltas[1:]:
        joined = merge_outputs(joined, delta, DELTA)
    last = whole[-1]
    assert joined.finished and last.finished
    assert joined.outputs == last.outputs, case
    assert joined.prompt_logprobs == last.prompt_logprobs
    if params.prompt_logprobs is not None:
        assert sum(d.prompt_logprobs is not None for d in deltas) == 1
    ended: set[int] = set()
    for delta in deltas:
        for completion in delta.outputs:
            assert completion.index not in ended, "an ended completion is listed again"
            assert completion.token_ids or completion.text or completion.finish_reason
            if completion.finish_reason is not None:
                ended.add(completion.index)
    assert len(deltas) > 2 and all(len(c.token_ids) <= 1 for d in deltas for c in d.outputs)
    assert merge_outputs(whole[0], whole[-1], CUMULATIVE) is whole[-1]


def test_an_unknown_output_kind_is_refused():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final")
