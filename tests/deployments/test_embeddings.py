"""/v1/embeddings on the session's Serve app through the official OpenAI SDK: the base
model's and an adapter's embeddings equal transformers' and PEFT's (last token,
normalized: the tiny model's folder names no pooling), as floats and as base64 (the
SDK's default), for text and token-id batches; bad input is a 4xx, and the tenant's
model access and limits apply as to completions."""

from __future__ import annotations

import openai
import pytest
import torch

TEXTS = ["w1 w2 w3", "w5 w9 w11 w13 w17", "w400"]
TOKEN_IDS = [[3, 1, 4, 1, 5, 9, 2, 6], [27, 18, 28]]


def hf_embeddings(base, adapter_folder, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The oracle: transformers' (and PEFT's unmerged adapter's) final hidden state at
    the last prompt token, L2-normalized."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter_folder is not None:
        model = PeftModel.from_pretrained(model, adapter_folder).get_base_model()
    model.eval()
    vectors = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden = model.model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]
            vectors.append(hidden / hidden.norm())
    return vectors


@pytest.fixture(scope="module")
def tiny_tokenizer(serve_setup):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(serve_setup.base)


@pytest.mark.parametrize("model, adapter", [("tiny", None), ("tiny:sa", "sa")])
def test_embeddings_equal_transformers_and_peft(
    client, serve_setup, tiny_tokenizer, model, adapter
):
    prompts = [tiny_tokenizer.encode(text) for text in TEXTS]
    folder = serve_setup.shared[adapter] if adapter else None
    want = hf_embeddings(serve_setup.base, folder, prompts + TOKEN_IDS)
    by_text = client.embeddings.create(model=model, input=TEXTS)
    as_floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    by_ids = client.embeddings.create(model=model, input=TOKEN_IDS)
    assert by_text.model == model and [d.index for d in by_text.data] == [0, 1, 2]
    assert by_text.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert by_ids.usage.prompt_tokens == by_ids.usage.total_tokens == 11
    got = [d.embedding for d in by_text.data] + [d.embedding for d in by_ids.data]
    for index, (vector, expected) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(
            torch.tensor(vector), expected, rtol=1e-4, atol=1e-5, msg=f"input {index}"
        )
    for base64_item, float_item in zip(by_text.data, as_floats.data, strict=True):
        assert torch.equal(
            torch.tensor(base64_item.embedding, dtype=torch.float32),
            torch.tensor(float_item.embedding, dtype=torch.float32),
        )


def test_an_adapters_embedding_differs_from_the_base_models(client):
    base = client.embeddings.create(model="tiny", input="w7 w8 w9").data[0].embedding
    adapted = client.embeddings.create(model="tiny:sb", input="w7 w8 w9").data[0].embedding
    assert len(base) == len(adapted) == 64
    assert not torch.allclose(torch.tensor(base), torch.tensor(adapted), atol=1e-3)


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"input": "w1", "dimensions": 32}, 400, "dimensions"),
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": [[]]}, 400, "input"),
        ({"input": "w1", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": [[600]]}, 400, "out of range"),
        ({"input": [[1] * 129]}, 400, "max_model_len"),
        ({"input": ["w1"] * 65}, 400, "at most 64"),
        ({"input": "w1", "model": "no-such-model"}, 404, "no-such-model"),
        ({"input": "w1", "model": "tiny:no-such-adapter"}, 404, "no-such-adapter"),
    ],
)
def test_bad_input_is_a_clear_4xx(post, body, status, needle):
    got, answer = post("/v1/embeddings", {"model": "tiny", **body})
    assert got == status, answer
    assert needle in answer["error"]["message"], answer


def test_a_tenant_embeds_only_with_the_models_and_adapters_it_may_use(tenant_client):
    globex = tenant_client("globex")
    assert globex.embeddings.create(model="tiny:sa", input="w1 w2").data[0].embedding
    for model in ("tiny:sb", "tiny-qwen"):
        with pytest.raises(openai.PermissionDeniedError):
            globex.embeddings.create(model=model, input="w1 w2")
    with pytest.raises(openai.AuthenticationError):
        tenant_client(None).embeddings.create(model="tiny", input="w1 w2")


def test_the_tenants_limits_apply(tenant_client):
    """`limited` runs one request at a time within 100 tokens a minute: a batch of two
    inputs, or one input of more tokens than the budget, can never pass."""
    limited = tenant_client("limited")
    with pytest.raises(openai.BadRequestError, match="concurrent"):
        limited.embeddings.create(model="tiny", input=["w1", "w2"])
    with pytest.raises(openai.BadRequestError, match="tokens_per_minute"):
        limited.embeddings.create(model="tiny", input=[list(range(1, 120))])
