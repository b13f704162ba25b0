"""tools/engine_bench/speculative.py on a tiny model: the command line parses, and a run
reports both workloads with and without speculation, the random one identical."""

from loraplex.tools import cli
from loraplex.tools.engine_bench import speculative

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def test_spec_bench_reports_both_workloads(tiny_model_factory):
    folder = tiny_model_factory("llama")
    args = cli.build_parser().parse_args(
        ["bench", "offline", "--speculative", "ngram", "--num-speculative-tokens", "3"]
    )
    assert (args.speculative, args.num_speculative_tokens, args.rounds) == ("ngram", 3, None)
    report = speculative.run_spec_bench(
        str(folder),
        "float32",
        NGRAM,
        num_requests=2,
        prompt_len=12,
        output_len=8,
        rounds=1,
        engine_options={"kv_cache_memory_bytes": 2**22},
        use_tqdm=False,
    )
    assert [(r.workload, r.speculative) for r in report.runs] == [
        ("copy-heavy", False),
        ("copy-heavy", True),
        ("random", False),
        ("random", True),
    ]
    assert report.summary("random")["identical"] == 1.0
    text = speculative.format_spec_report(report)
    assert "copy-heavy: base" in text and "acceptance rate" in text and "loadavg" in text
