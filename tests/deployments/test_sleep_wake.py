"""Sleep and wake through the operator API on the session's app: a model's replicas
release their KV cache (and report how long it took), its requests get 503
`model_asleep` with Retry-After meanwhile, and once woken it answers as before."""

from __future__ import annotations

import openai
import pytest

MODEL = "tiny-tight"


def test_an_operator_puts_a_model_to_sleep_and_wakes_it(post, client, operator_key):
    def answer() -> str:
        return (
            client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0)
            .choices[0]
            .text
        )

    before = answer()
    status, slept = post(f"/v1/admin/models/{MODEL}/sleep", {}, operator_key)
    try:
        assert status == 200, slept
        assert slept["asleep"] is True and slept["replicas"]
        for replica in slept["replicas"]:
            assert replica["kv_cache_bytes"] > 0 and replica["seconds"] >= 0
        again = post(f"/v1/admin/models/{MODEL}/sleep", {}, operator_key)
        assert again[0] == 200 and again[1]["replicas"][0]["asleep_already"], again
        with pytest.raises(openai.InternalServerError) as refused:
            answer()
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "model_asleep"
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert client.completions.create(model="tiny", prompt=[5, 6], max_tokens=2).choices
    finally:
        status, woke = post(f"/v1/admin/models/{MODEL}/wake", {}, operator_key)
    assert status == 200 and woke["asleep"] is False, woke
    assert woke["replicas"][0]["kv_cache_bytes"] == slept["replicas"][0]["kv_cache_bytes"]
    assert answer() == before


@pytest.mark.parametrize("action", ["sleep", "wake"])
def test_only_the_operator_may_and_only_for_a_model_that_exists(post, operator_key, action):
    status, answer = post(f"/v1/admin/models/{MODEL}/{action}", {})
    assert status == 401, answer
    status, answer = post(f"/v1/admin/models/no-such-model/{action}", {}, operator_key)
    assert status == 404, answer
