"""Tenant adapters saved with `modules_to_save` on the session's Serve app, through the
official OpenAI SDK: registered by a tenant, answered equal to PEFT (greedy, token for
token) beside the base model; a resized vocabulary reads and writes text and logprobs in
the adapter's own tokenizer; what the model cannot serve is a 400 naming why; the
adapters' memory shows at /metrics."""

from __future__ import annotations

import shutil
import time
import urllib.request

import pytest

from loraplex.adapters.peft_format import CONFIG_NAME

BOTH = ("lm_head", "embed_tokens")


@pytest.fixture(scope="module")
def registered(serve_setup, post, peft_adapter_factory, tmp_path_factory):
    """acme's adapters `own-head` (its own LM head and embeddings) and `new-words` (a
    vocabulary resized to 520 tokens, with its tokenizer), registered on `tiny`."""
    made = tmp_path_factory.mktemp("saved-modules")
    folders = {
        "own-head": peft_adapter_factory(
            serve_setup.base, made / "own-head", modules_to_save=BOTH, seed=41
        ),
        "new-words": peft_adapter_factory(
            serve_setup.base, made / "new-words", modules_to_save=BOTH, vocab_size=520, seed=42
        ),
    }
    for name, folder in folders.items():
        target = serve_setup.adapter_root / "acme" / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(folder, target)
        status, body = post("/v1/adapters", {"model": "tiny", "name": name, "path": name})
        assert status == 201, body
    return folders


def test_an_adapter_with_its_own_head_and_embeddings_answers_like_peft(
    client, serve_setup, registered, peft_oracle, hf_greedy
):
    prompt = [5, 17, 99, 3, 250, 7]
    model = peft_oracle(serve_setup.base, registered["own-head"])
    [want] = hf_greedy(model, [prompt], 8)
    [base_want] = hf_greedy(peft_oracle(serve_setup.base, None), [prompt], 8)
    assert want != base_want
    for name, expected in (("tiny:own-head", want), ("tiny", base_want)):
        reply = client.completions.create(
            model=name,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].logprobs.tokens == [f"w{t}" for t in expected], name


def test_a_resized_vocabulary_speaks_its_new_words(
    client, serve_setup, registered, peft_oracle, hf_greedy
):
    """Text in and out through the adapter's tokenizer: a prompt holding new words, a
    completion (streamed) and its logprobs equal to PEFT on the resized base."""
    prompt_text = "w3 w515 w7 w519 w11"
    prompt = [3, 515, 7, 519, 11]
    model = peft_oracle(serve_setup.base, registered["new-words"])
    [want] = hf_greedy(model, [prompt], 10)
    chunks = client.completions.create(
        model="tiny:new-words",
        prompt=prompt_text,
        max_tokens=10,
        temperature=0,
        logprobs=2,
        echo=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, tokens, usage = "", [], None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.text
            tokens += choice.logprobs.tokens if choice.logprobs else []
    assert usage.prompt_tokens == 5 and usage.completion_tokens == 10
    words = [f"w{t}" for t in want]
    assert text.split() == prompt_text.split() + words
    assert tokens[-10:] == words


def test_what_the_model_cannot_serve_is_a_400(client, serve_setup, registered, post):
    import openai

    with pytest.raises(openai.BadRequestError, match="out of range"):
        client.completions.create(model="tiny", prompt=[3, 515], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="resizes the vocabulary"):
        client.completions.create(
            model="tiny:new-words",
            prompt="w3",
            max_tokens=2,
            extra_body={"structured_outputs": {"regex": "w1"}},
        )
    target = serve_setup.adapter_root / "acme" / "new-words-tight"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(registered["new-words"], target)
    status, body = post(
        "/v1/adapters", {"model": "tiny-tight", "name": "new-words-tight", "path": target.name}
    )
    assert status == 400 and "serves 512 to 512" in body["error"]["message"], body
    (target / CONFIG_NAME).write_text('{"peft_type": "LORA", "modules_to_save": ["score"]}')
    status, body = post("/v1/adapters", {"model": "tiny", "name": "bad-saved", "path": target.name})
    assert status == 400 and "modules_to_save" in body["error"]["message"], body


def test_adapter_memory_shows_at_metrics(serve_url, operator_key, registered, client):
    """The host tier's bytes of `tiny`'s replica count the saved modules (two tables of
    512 x 64 float32) once `own-head` is held."""
    client.completions.create(model="tiny:own-head", prompt=[1, 2], max_tokens=1)
    scrape = urllib.request.Request(
        f"{serve_url}/metrics", headers={"Authorization": f"Bearer {operator_key}"}
    )
    deadline = time.monotonic() + 60
    while True:
        with urllib.request.urlopen(scrape, timeout=30) as response:
            lines = response.read().decode().splitlines()
        host = [
            float(line.rsplit(" ", 1)[1])
            for line in lines
            if line.startswith("loraplex_adapter_memory_bytes{")
            and 'tier="host"' in line
            and 'model_name="tiny"' in line
        ]
        if host and max(host) >= 2 * 512 * 64 * 4:
            break
        assert time.monotonic() < deadline, f"host tier bytes at /metrics: {host}"
        time.sleep(2)
