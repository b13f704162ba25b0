"""`loraplex bench serve` against the session's real Serve app over HTTP: a tiny
workload over the base model and an adapter whose counts must add up, its JSON and PNG,
and Poisson arrivals; plus what the bench reports for failed requests."""

from __future__ import annotations

import json

from loraplex.cli import main


def test_bench_serve_smoke_counts_add_up(serve_setup, tenant_keys, tmp_path, capsys):
    code = main(
        [
            "bench", "serve",
            "--url", serve_setup.url,
            "--api-key", tenant_keys["acme"],
            "--model", "tiny",
            "--adapters", "sa,tiny:sb",
            "--compare-base",
            "--tokenizer", str(serve_setup.base),
            "--num-prompts", "6",
            "--prompt-len", "8",
            "--prefix-len", "4",
            "--output-len", "5",
            "--max-concurrency", "3",
            "--output-dir", str(tmp_path),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "[base-1] 6/6 completed" in out and "[adapters-1] 6/6 completed" in out
    assert "adapters/base tok/s" in out and "machine:" in out
    data = json.loads((tmp_path / "bench_serve.json").read_text())
    assert [b["name"] for b in data["bursts"]] == ["base-1", "adapters-1"]
    for burst, records in zip(data["bursts"], data["requests"], strict=True):
        assert burst["completed"] == 6 and burst["failures"] == {}
        assert burst["output_tokens"] == 6 * 5 == sum(r["output_tokens"] for r in records)
        assert all(r["prompt_len"] == 12 and r["error"] is None for r in records)
        assert burst["ttft"]["count"] == 6 and burst["itl"]["count"] >= 6
    models = [r["model"] for r in data["requests"][1]]
    assert models == ["tiny:sa", "tiny:sb"] * 3
    assert (tmp_path / "bench_serve.png").stat().st_size > 10_000


def test_bench_serve_poisson_arrivals_and_failures_are_counted(
    serve_setup, tenant_keys, tmp_path, capsys
):
    code = main(
        [
            "bench", "serve",
            "--url", serve_setup.url,
            "--api-key", tenant_keys["globex"],
            "--model", "tiny",
            "--adapters", "sa,sb",
            "--tokenizer", str(serve_setup.base),
            "--num-prompts", "4",
            "--prompt-len", "6",
            "--output-len", "3",
            "--request-rate", "20",
            "--no-stream",
            "--output-dir", str(tmp_path),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1, out
    data = json.loads((tmp_path / "bench_serve.json").read_text())
    (burst,) = data["bursts"]
    # globex may use tiny:sa but not tiny:sb (403)
    assert burst["completed"] == 2 and burst["failures"] == {"status 403": 2}
    assert burst["output_tokens"] == 2 * 3
    sent = [r["sent_s"] for r in data["requests"][0]]
    assert sent == sorted(sent) and sent[-1] > 0
