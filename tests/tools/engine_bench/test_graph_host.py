"""tools/engine_bench/graph_host.py: every decode step goes through the decode graphs,
and the host time left after the forward and the greedy kernel is positive and below
the step's wall time."""

from __future__ import annotations

import os

from loraplex.kernels.selection import KERNEL_BACKEND_ENV
from loraplex.tools.engine_bench.graph_host import format_report, run


def test_graph_host_on_a_tiny_model(tiny_model_factory):
    """The tool forces the torch kernels only while it builds its engine: afterwards the
    process's environment is as it was, so later engines pick their backend as before."""
    forced = os.environ.get(KERNEL_BACKEND_ENV)
    figures = run(tiny_model_factory("llama"), batches=[1, 4], output_len=6, rounds=2)
    assert os.environ.get(KERNEL_BACKEND_ENV) == forced
    assert [f.batch for f in figures] == [1, 4]
    for figure in figures:
        assert len(figure.rounds) == 2
        assert 0 < figure.host_us < figure.step_us
    text = format_report(figures, ("0.1 0.1 0.1", "0.2 0.2 0.2"))
    assert "batch   4: host" in text and "loadavg before 0.1 0.1 0.1" in text
