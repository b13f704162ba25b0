"""Glob keys matched without regular expressions (adapters/module_globs.py) against the
reference, `fnmatch.fnmatchcase`."""

from __future__ import annotations

import fnmatch
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.adapters.module_globs import ModuleGlob

PATTERN_CHARS = st.sampled_from(list("ab.*?[]!-_0"))
NAME_CHARS = st.sampled_from(list("ab.-_0]![?*"))


@settings(max_examples=3000, deadline=None)
@given(st.text(PATTERN_CHARS, max_size=12), st.text(NAME_CHARS, max_size=12))
def test_a_glob_matches_exactly_what_fnmatch_matches(pattern, name):
    assert ModuleGlob.parse(pattern).fullmatch(name) == fnmatch.fnmatchcase(name, pattern)


def test_module_names_and_peft_style_keys():
    cases = {
        ("*q_proj", "model.layers.0.self_attn.q_proj"): True,
        ("model.layers.[0-1].*", "model.layers.1.mlp.up_proj"): True,
        ("model.layers.[!0-1].*", "model.layers.1.mlp.up_proj"): False,
        ("*.layers.?.self_attn.*_proj", "model.layers.7.self_attn.v_proj"): True,
        ("*.layers.??.self_attn.*", "model.layers.7.self_attn.v_proj"): False,
        ("q_proj", "q_proj"): True,
        ("q_proj", "k_proj"): False,
    }
    for (pattern, name), expected in cases.items():
        assert ModuleGlob.parse(pattern).fullmatch(name) is expected, (pattern, name)


def test_the_worst_keys_cost_milliseconds():
    """256-character keys of 126 `*`s, against names built to make a backtracking
    matcher try every split."""
    keys = ["*a" * 125 + f"*{i:05d}" for i in range(1024)]
    started = time.monotonic()
    globs = [ModuleGlob.parse(key) for key in keys]
    for glob in globs[:64]:
        assert not glob.fullmatch("a" * 200 + "0000x")
        assert not glob.fullmatch("model.layers.0.self_attn.q_proj")
    assert time.monotonic() - started < 2.0
