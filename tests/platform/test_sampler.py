"""Sampler: greedy, filters, penalties, seeded draws, distribution, logprobs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from loraplex.kernels.backends import get_backend
from loraplex.platform.request import Request, SamplingParams
from loraplex.platform.sampler import (
    Sampler,
    SamplingBatch,
    apply_min_p,
    apply_penalties,
    apply_token_rules,
    apply_top_k_top_p,
    draw_inverse_cdf,
)

CPU = torch.device("cpu")
VOCAB = 32


def make_request(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    name: str = "r",
) -> Request:
    request = Request(name, list(prompt or [1, 2, 3]), params)
    for token_id in output or []:
        request.append_output_token(token_id, None)
    return request


def sample(logits: torch.Tensor, requests: list[Request]):
    return Sampler()(logits, SamplingBatch.from_requests(requests, CPU))


def random_logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * 3


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_greedy_fast_path_is_argmax(kernels):
    """With either kernel backend's greedy_tokens, ties going to the first index."""
    logits = random_logits(6).round()
    requests = [make_request(SamplingParams(temperature=0.0)) for _ in range(6)]
    batch = SamplingBatch.from_requests(requests, CPU)
    assert batch.fast_greedy
    out = Sampler(get_backend(kernels))(logits, batch)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    logits = random_logits(4, seed=1)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.8, top_k=5),
    ]
    out = sample(logits, [make_request(p) for p in params])
    argmax = logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == argmax[0]
    assert out.token_ids[2] == argmax[2]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
        SamplingParams(temperature=1.5, min_p=1.0),
        SamplingParams(temperature=1.5, top_p=5e-324, logprobs=2, repetition_penalty=3.0),
    ],
    ids=["top_k=1", "tiny top_p", "min_p=1", "top_p 0 in float32 (found by the fuzzer)"],
)
def test_degenerate_filters_are_greedy(params):
    logits = random_logits(8, seed=2)
    for seed in range(5):
        requests = [make_request(params, name=f"r{i}") for i in range(8)]
        torch.manual_seed(seed)
        assert sample(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_repetition_penalty_of_float32_zero_samples_a_seen_token(temperature):
    """5e-324 passes `> 0` but is 0 in float32: the penalty must not turn the seen
    tokens' logits into inf / NaN (an out-of-range token id; found by the fuzzer)."""
    logits = random_logits(4, seed=7, vocab=512)
    params = SamplingParams(temperature=temperature, repetition_penalty=5e-324, logprobs=2)
    requests = [make_request(params, prompt=[3, 5], name=f"r{i}") for i in range(4)]
    out = sample(logits, requests)
    assert out.invalid_rows == []
    assert all(0 <= token < 512 for token in out.token_ids), out.token_ids
    if temperature == 0.0:
        seen = logits[:, [3, 5]]
        penalized = logits.clone()
        penalized[:, [3, 5]] = torch.where(seen > 0, seen / 1e-5, seen * 1e-5)
        assert out.token_ids == penalized.argmax(dim=-1).tolist()


@pytest.mark.parametrize("max_top_k", [0, 2, 3])
def test_top_k_and_top_p_masks(max_top_k):
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    logits = probs.log()
    kept_k = apply_top_k_top_p(logits, torch.tensor([2]), None, max_top_k)
    assert torch.isfinite(kept_k).tolist() == [[False, True, False, True]]
    assert torch.equal(kept_k[0, [1, 3]], logits[0, [1, 3]])
    # top-p applies to the top-k survivors: of {0.5, 0.3} renormalised, 0.6 takes 0.5 alone.
    kept_both = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.6]), max_top_k)
    assert torch.isfinite(kept_both).tolist() == [[False, True, False, False]]


def test_top_p_alone_and_disabled():
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    kept_p = apply_top_k_top_p(logits, None, torch.tensor([0.75]))
    assert torch.isfinite(kept_p).tolist() == [[False, True, False, True]]
    kept_none = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([1.0]))
    assert torch.equal(kept_none, logits)
    tiny_tail = torch.tensor([[30.0, 0.0, -5.0, -80.0]])
    assert torch.equal(apply_top_k_top_p(tiny_tail, None, torch.tensor([1.0])), tiny_tail)


def test_min_p_mask():
    weights = torch.tensor([[1.0, 0.6, 0.3, 0.1], [1.0, 1.0, 1.0, 1.0]])
    kept = apply_min_p(weights, torch.tensor([0.5, 0.9]))
    assert (kept > 0).tolist() == [[True, True, False, False], [True, True, True, True]]


def test_inverse_cdf_draw_never_picks_zero_weight():
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0]]).expand(5, 5)
    uniforms = torch.tensor([0.0, 0.5, 0.66, 0.67, 1.0 - 2**-24])
    assert draw_inverse_cdf(weights, uniforms).tolist() == [1, 1, 1, 3, 3]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.75), {0, 1}),
        (SamplingParams(min_p=0.4), {0, 1}),
        (SamplingParams(min_p=0.2), {0, 1, 2}),
    ],
    ids=["top_k", "top_p", "min_p", "min_p-wider"],
)
def test_filtered_draws_stay_in_the_allowed_set(params, allowed):
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(400, 4).contiguous()
    requests = [make_request(replace(params, seed=i), name=f"r{i}") for i in range(400)]
    assert set(sample(logits, requests).token_ids) == allowed


def reference_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Row by row, token by token: HF repetition penalty, then OpenAI penalties."""
    out = logits.clone()
    for row, request in enumerate(requests):
        params = request.sampling_params
        for token_id in set(request.prompt_token_ids) | set(request.output_token_ids):
            value = out[row, token_id].item()
            penalty = params.repetition_penalty
            out[row, token_id] = value / penalty if value > 0 else value * penalty
        for token_id in set(request.output_token_ids):
            count = request.output_token_ids.count(token_id)
            out[row, token_id] -= params.frequency_penalty * count + params.presence_penalty
    return out


def test_penalties_match_reference():
    logits = random_logits(4, seed=4)
    requests = [
        make_request(SamplingParams(repetition_penalty=1.3), [1, 2, 5], [5, 7, 7]),
        make_request(SamplingParams(presence_penalty=0.5), [3, 4], [4, 4, 9]),
        make_request(SamplingParams(frequency_penalty=0.7), [3], [10, 10, 10, 11]),
        make_request(
            SamplingParams(repetition_penalty=0.8, presence_penalty=-0.4, frequency_penalty=1.5),
            [0, 1, 2, 3, 31],
            [31, 6, 6],
        ),
    ]
    batch = SamplingBatch.from_requests(requests, CPU)
    assert torch.allclose(apply_penalties(logits, batch), reference_penalties(logits, requests))


def test_penalties_change_greedy_picks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    plain = make_request(SamplingParams(temperature=0.0), [0], [1])
    penalised = make_request(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0], [1])
    assert sample(logits, [plain]).token_ids == [1]
    assert sample(logits, [penalised]).token_ids == [2]
    frequency = make_request(SamplingParams(temperature=0.0, frequency_penalty=1.0), [1], [1, 1])
    assert sample(logits, [frequency]).token_ids == [2]


def draw_sequence(
    params: SamplingParams,
    logits_row: torch.Tensor,
    others: list[Request],
    position: int,
    steps: int,
) -> list[int]:
    """Tokens a seeded request draws over `steps` steps while sharing its batch."""
    target = make_request(params, name="target")
    tokens = []
    for step in range(steps):
        requests = list(others)
        requests.insert(position, target)
        filler = random_logits(len(requests), seed=100 + step)
        filler[position] = logits_row
        tokens.append(sample(filler, requests).token_ids[position])
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, seed=1234),
        SamplingParams(temperature=0.9, top_p=0.95, seed=1234),
        SamplingParams(temperature=0.9, top_k=6, top_p=0.9, min_p=0.02, seed=1234),
    ],
    ids=["plain", "top_p", "top_k+top_p+min_p"],
)
def test_seeded_draws_ignore_batch_composition(params):
    row = random_logits(1, seed=5)[0] / 3
    alone = draw_sequence(params, row, [], 0, steps=8)
    mixed = [
        make_request(SamplingParams(temperature=1.0, top_p=0.5), name="a"),
        make_request(SamplingParams(temperature=0.5, seed=7, top_k=3), name="b"),
        make_request(SamplingParams(temperature=0.0, logprobs=1), name="c"),
        make_request(SamplingParams(presence_penalty=1.0), [4], [5, 5], name="d"),
    ]
    assert draw_sequence(params, row, mixed, 2, steps=8) == alone
    torch.manual_seed(99)
    assert draw_sequence(params, row, mixed[1:2], 0, steps=8) == alone
    assert draw_sequence(params, row, mixed[::-1], 4, steps=8) == alone
    assert len(set(alone)) > 1


def test_same_seed_different_child_index_differs():
    logits = torch.zeros(2, 1000)
    first = Request("a", [1], SamplingParams(seed=11), index=0)
    second = Request("a-1", [1], SamplingParams(seed=11), index=1)
    tokens = sample(logits, [first, second]).token_ids
    assert tokens[0] != tokens[1]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (
            SamplingParams(temperature=0.7),
            (torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]) / 0.7).softmax(0),
        ),
        (SamplingParams(top_k=2), torch.tensor([2.0, 1.0]).softmax(0).tolist() + [0, 0, 0]),
        (SamplingParams(top_p=0.8), torch.tensor([2.0, 1.0, 0.5]).softmax(0).tolist() + [0, 0]),
    ],
    ids=["temperature", "top_k", "top_p"],
)
def test_sampling_frequencies_follow_the_kept_softmax(params, expected):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    rows = 6000
    requests = [make_request(params, name=f"r{i}") for i in range(rows)]
    torch.manual_seed(0)
    tokens = torch.tensor(sample(logits.expand(rows, 5).contiguous(), requests).token_ids)
    frequencies = torch.bincount(tokens, minlength=5).float() / rows
    expected = torch.as_tensor(expected, dtype=torch.float32)
    assert torch.allclose(frequencies, expected, atol=0.02, rtol=0), (frequencies, expected)


def test_seeded_sampling_follows_softmax():
    logits = torch.tensor([1.0, 0.0, -0.5])
    rows = 3000
    requests = [make_request(SamplingParams(seed=i), name=f"r{i}") for i in range(rows)]
    tokens = torch.tensor(sample(logits.expand(rows, 3).contiguous(), requests).token_ids)
    frequencies = torch.bincount(tokens, minlength=3).float() / rows
    expected = logits.softmax(dim=-1)
    assert torch.allclose(frequencies, expected, atol=0.03, rtol=0), (frequencies, expected)


def test_logprobs_are_raw_log_softmax_with_sorted_top():
    logits = random_logits(3, seed=6)
    requests = [
        make_request(
            SamplingParams(temperature=0.5, repetition_penalty=1.5, logprobs=4), [1, 2], [3]
        ),
        make_request(SamplingParams(temperature=0.0, logprobs=0)),
        make_request(SamplingParams(temperature=1.0)),
    ]
    out = sample(logits, requests)
    raw = logits.log_softmax(dim=-1)
    first, second, third = out.logprobs
    assert third is None
    assert first.token_id == out.token_ids[0]
    assert math.isclose(first.logprob, raw[0, first.token_id].item(), rel_tol=1e-6)
    assert len(first.top) == 4
    assert list(first.top) == raw[0].argsort(descending=True)[:4].tolist()
    values = list(first.top.values())
    assert values == sorted(values, reverse=True)
    for token_id, value in first.top.items():
        assert math.isclose(value, raw[0, token_id].item(), rel_tol=1e-6)
    assert second.top == {}
    assert second.token_id == logits[1].argmax().item()
    assert math.isclose(second.logprob, raw[1].max().item(), rel_tol=1e-6)


def test_non_float32_logits_and_oversized_top_k():
    logits = random_logits(2, seed=7).to(torch.bfloat16)
    requests = [
        make_request(SamplingParams(top_k=10 * VOCAB, seed=1), name="a"),
        make_request(SamplingParams(temperature=0.0), name="b"),
    ]
    out = sample(logits, requests)
    assert 0 <= out.token_ids[0] < VOCAB
    assert out.token_ids[1] == logits[1].float().argmax().item()


def reference_token_rules(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Plain per-row loops: logit_bias added, then EOS / stop ids at -inf before
    min_tokens."""
    out = logits.clone().float()
    for row, request in enumerate(requests):
        params = request.sampling_params
        for token, bias in params.logit_bias:
            out[row, token] += bias
        if len(request.output_token_ids) < params.min_tokens:
            banned = [] if params.ignore_eos else list(request.eos_token_ids)
            for token in [*banned, *params.stop_token_ids]:
                out[row, token] = float("-inf")
    return out


def test_logit_bias_and_min_tokens_match_the_reference():
    logits = random_logits(5, seed=7)
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 100.0, 5: -100.0}),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=(9, 10)),
        SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=(9,), ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=2, logit_bias=[(0, 1.5)]),
    ]
    requests = [make_request(p, output=[1] * (3 if i == 4 else 0)) for i, p in enumerate(params)]
    for request in requests:
        request.eos_token_ids = frozenset({0, 1})
    batch = SamplingBatch.from_requests(requests, CPU)
    assert not batch.fast_greedy
    expected = reference_token_rules(logits, requests)
    got = apply_token_rules(logits.float(), batch)
    assert torch.equal(got, expected)
    out = Sampler()(logits, batch)
    assert out.token_ids == expected.argmax(dim=-1).tolist()
    assert out.token_ids[0] == 3
    assert out.token_ids[2] not in (0, 1, 9, 10) and out.token_ids[3] not in (9,)


def test_min_tokens_keeps_eos_away_until_reached():
    """A model whose top token is EOS generates min_tokens tokens, then stops on EOS."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 10.0
    params = SamplingParams(temperature=0.0, min_tokens=2)
    request = make_request(params)
    request.eos_token_ids = frozenset({0})
    first = sample(logits, [request]).token_ids[0]
    request.append_output_token(first, None)
    second = sample(logits, [request]).token_ids[0]
    request.append_output_token(second, None)
    third = sample(logits, [request]).token_ids[0]
    assert first != 0 and second != 0 and third == 0


def test_logit_bias_moves_seeded_draws():
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(temperature=1.0, seed=3, logit_bias={7: 100.0})
    assert {sample(logits, [make_request(params)]).token_ids[0] for _ in range(5)} == {7}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"stop_token_ids": (-2,)}, "stop_token_ids"),
    ],
)
def test_bad_token_rules_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)
