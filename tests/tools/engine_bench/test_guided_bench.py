"""tools/engine_bench/guided.py on a tiny model: every run produces exactly its tokens
(guided answers cannot end early), one time per kind and round."""

from loraplex.tools.engine_bench.guided import KINDS, run_guided_bench


def test_guided_bench_runs_every_kind_to_its_full_length(tiny_model_factory):
    report = run_guided_bench(
        model=str(tiny_model_factory("llama", tokenizer="bytes")),
        dtype="float32",
        num_requests=4,
        prompt_len=8,
        output_len=12,
        rounds=2,
        seed=0,
        engine_options={"max_num_seqs": 4, "max_model_len": 64},
    )
    assert all(len(report.seconds[kind]) == 2 for kind in KINDS)
    assert report.ratio("json") > 0 and report.ratio("regex") > 0
