"""Every code block of README.md and docs/*.md runs here, or where it cannot, its command
line is parsed by the parser that would read it (tests/doc_blocks.py says which, and why).

A code block (bash, python, yaml, json) that no entry covers fails
`test_every_code_block_is_covered`; untagged and `text` blocks are diagrams and printed
output, not code. Here: engine blocks (python, run in a subprocess on a tiny model; the
speculative yaml, parsed by the serve config's loader), `loraplex` engine commands run
in-process with REDUCTIONS, and every command line's parse. What needs a running app
(curl, `bench serve`, the app's python, json and yaml blocks) runs in
tests/deployments/test_docs_requests.py against the session's Serve app.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import yaml
from doc_blocks import (
    APP,
    BLOCKS,
    CLICK_COMMANDS,
    CODE_LANGUAGES,
    COMMANDS,
    ENGINE,
    ENGINE_MACHINE_BYTES,
    NOT_COVERED,
    REPO,
    SCRIPT_FORWARDS,
    SMALL_MACHINE,
    SUBSTITUTIONS,
    TEXT_LANGUAGES,
    Command,
    all_commands,
    block_coverage,
    block_script,
    blocks_run,
    code_blocks,
    command_rule,
    commands_run,
    coverage_rows,
    doc_blocks,
    fenced_blocks,
    reduced_argv,
    run_python,
    shell_commands,
    substitute,
)

from loraplex.cli import main as loraplex_main

logger = logging.getLogger(__name__)
PACKAGE_FOLDERS = ("_loraplex", "platform", "adapters", "kernels", "deployments")


def test_every_code_block_is_covered():
    """A code block nothing runs or parses fails here: add a BLOCKS entry (python, yaml,
    json) or a COMMANDS rule (bash) in tests/doc_blocks.py, with the test that runs it.
    The log has the whole table."""
    rows = coverage_rows()
    logger.info("doc code blocks:\n%s", "\n".join(" | ".join(row) for row in rows))
    unknown = [
        f"{block.where} ({block.language}): a language neither run nor read as text"
        for block in doc_blocks()
        if block.language not in CODE_LANGUAGES + TEXT_LANGUAGES
    ]
    uncovered = [
        f"{where} ({language}): {why}" for where, language, how, why in rows if how == NOT_COVERED
    ]
    assert not unknown + uncovered, "uncovered doc code:\n" + "\n".join(unknown + uncovered)


def test_every_entry_covers_something():
    """A BLOCKS entry, COMMANDS rule or substitution that matches nothing is stale."""
    blocks = code_blocks()
    stale_blocks = [
        key
        for key in BLOCKS
        if not any(block.path == key[0] and block.first_line.startswith(key[1]) for block in blocks)
    ]
    rules_used = {command_rule(command) for command in all_commands()}
    stale_rules = [rule.program for rule in COMMANDS if rule not in rules_used]
    texts = "\n".join(block.text for block in blocks)
    stale_substitutions = [
        doc_text
        for table in SUBSTITUTIONS.values()
        for doc_text, _ in table
        if doc_text not in texts
    ]
    assert not stale_blocks, f"BLOCKS entries matching no block: {stale_blocks}"
    assert not stale_rules, f"COMMANDS rules matching no command: {stale_rules}"
    assert not stale_substitutions, f"SUBSTITUTIONS found in no block: {stale_substitutions}"


def test_the_coverage_guard_sees_a_new_block(tmp_path):
    """The guard's own check: an indented python block and a bash command of a program
    no rule knows, on a new page, are read with their lines and are uncovered."""
    page = tmp_path / "docs" / "new.md"
    page.parent.mkdir()
    page.write_text("text\n\n  ```python\n  print('new')\n  ```\n\n```bash\nmake it\n```\n")
    new_python, new_bash = fenced_blocks(page, root=tmp_path)
    assert (new_python.where, new_python.text) == ("docs/new.md:3", "print('new')")
    assert block_coverage(new_python) is None
    assert [command_rule(command) for command in shell_commands(new_bash)] == [None]


# ---- engine blocks ------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_values(tiny_model_factory, peft_adapter_factory, tmp_path_factory) -> dict[str, str]:
    """What SUBSTITUTIONS[ENGINE] and REDUCTIONS put in a block: the tiny Llama and two
    PEFT adapters of it (rank 4 on q/v, rank 8 on every projection)."""
    base = tiny_model_factory("llama")
    folder = tmp_path_factory.mktemp("doc-adapters")
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    french = peft_adapter_factory(base, folder / "french", rank=4, seed=1)
    pirate = peft_adapter_factory(base, folder / "pirate", rank=8, target_modules=every, seed=2)
    return {"tiny_model": str(base), "adapter_french": str(french), "adapter_pirate": str(pirate)}


@pytest.mark.parametrize("block", blocks_run(ENGINE, "python"), ids=lambda block: block.where)
def test_engine_python_block_runs(block, engine_values):
    code = substitute(block_script(block), ENGINE, engine_values)
    done = run_python(SMALL_MACHINE + code)
    assert done.returncode == 0, f"{block.where} failed:\n{done.stderr[-3000:]}"


def yaml_blocks_starting(start: str) -> list:
    return [b for b in blocks_run(ENGINE, "yaml") if b.first_line.startswith(start)]


def test_every_engine_yaml_block_is_a_model_entry_or_tenants():
    assert {b.first_line.split(":")[0] for b in blocks_run(ENGINE, "yaml")} <= {"engine", "tenants"}


@pytest.mark.parametrize("block", yaml_blocks_starting("engine:"), ids=lambda block: block.where)
def test_engine_yaml_block_is_a_valid_model_entry(block, monkeypatch):
    """The block is part of a `models` entry: merged into serve_config.yaml's first model,
    the app's config loader (what build_app parses) must accept it and hand each value
    to the engine."""
    from loraplex.deployments.config import PlatformConfig

    monkeypatch.chdir(REPO)  # serve_config.yaml's adapter folders are relative
    fragment = yaml.safe_load(block.text)
    args = serve_config_args()
    args["models"][0] = deep_merge(args["models"][0], fragment)
    config = PlatformConfig.model_validate(args)
    speculative = config.models[0].engine_config().speculative
    for option, value in fragment["engine"]["speculative_config"].items():
        assert getattr(speculative, option) == value, f"{block.where}: {option}"


@pytest.mark.parametrize("block", yaml_blocks_starting("tenants:"), ids=lambda block: block.where)
def test_tenants_yaml_block_is_a_valid_tenants_list(block, monkeypatch, tmp_path):
    """The block replaces serve_config.yaml's tenants: the app's config loader accepts
    it, and every adapter source builds its storage options once its credential
    references resolve (to values set here)."""
    from loraplex.deployments.config import PlatformConfig

    monkeypatch.chdir(REPO)
    fragment = yaml.safe_load(block.text)
    config = PlatformConfig.model_validate({**serve_config_args(), **fragment})
    sources = [source for tenant in config.tenants for source in tenant.adapter_sources]
    assert sources, f"{block.where}: no adapter source"
    for source in sources:
        for field in ("access_key_id", "secret_access_key", "session_token", "bearer_token"):
            reference = getattr(source, field)
            if reference is not None and reference.env is not None:
                monkeypatch.setenv(reference.env, f"value-of-{field}")
            elif reference is not None:
                secret = tmp_path / field
                secret.write_text(f"value-of-{field}")
                source = source.model_copy(update={field: type(reference)(file=str(secret))})
        access = source.access()
        assert access.storage_options, source.prefix
        assert repr(access).count("value-of-") == 0


def serve_config_args() -> dict:
    """serve_config.yaml's loraplex application args."""
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    return next(app for app in config["applications"] if app["name"] == "loraplex")["args"]


def deep_merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        both_maps = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = deep_merge(merged[key], value) if both_maps else value
    return merged


@pytest.mark.parametrize("command", commands_run(ENGINE), ids=lambda command: command.where)
def test_engine_command_runs_reduced(command, engine_values, capsys, monkeypatch):
    monkeypatch.setattr(
        "loraplex.platform.kv_cache.device_memory_bytes", lambda device: ENGINE_MACHINE_BYTES
    )
    argv = reduced_argv(list(command.words[1:]), engine_values)
    code = loraplex_main(argv)
    out = capsys.readouterr().out
    logger.info("loraplex %s\n%s", " ".join(argv), out)
    assert code == 0 and out.strip(), f"{command.where}: `loraplex {' '.join(argv)}` -> {code}"


# ---- every command line, parsed by what would read it --------------------------------


class ParsedOnly(Exception):
    def __init__(self, namespace: argparse.Namespace):
        super().__init__("parsed")
        self.namespace = namespace


@contextmanager
def stop_after_parsing():
    """`ArgumentParser.parse_args` parses for real and then stops the program, so a
    command line goes through the real parser without running."""
    real_parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        raise ParsedOnly(real_parse_args(parser, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        yield


def parse_loraplex(argv: list[str], capsys) -> argparse.Namespace:
    """`loraplex.cli.main`'s own parser on argv; an unknown or malformed option fails."""
    try:
        with stop_after_parsing():
            loraplex_main(argv)
    except ParsedOnly as parsed:
        return parsed.namespace
    except SystemExit as exit_:
        pytest.fail(
            f"`loraplex {' '.join(argv)}` does not parse ({exit_.code}):\n{capsys.readouterr().err}"
        )
    pytest.fail(f"`loraplex {' '.join(argv)}` ran without parsing its arguments")


def check_loraplex(command: Command, capsys) -> None:
    args = parse_loraplex(list(command.words[1:]), capsys)
    assert callable(args.handler), command.where


def check_bash_script(command: Command, capsys) -> None:
    script = REPO / command.words[1]
    assert script.is_file(), f"{command.where}: {script} is missing"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, f"{command.where}: {done.stderr}"


def check_python(command: Command, capsys) -> None:
    """`python -m MODULE` needs the module; `python SCRIPT ...` its every flag in the
    script's --help, and the options it forwards after `--` parsed by their command."""
    words = list(command.program[1:])
    if words[0] == "-m":
        assert importlib.util.find_spec(words[1]), f"{command.where}: no module {words[1]}"
        return
    script, options = words[0], words[1:]
    forwarded = options[options.index("--") + 1 :] if "--" in options else []
    own = options[: options.index("--")] if "--" in options else options
    assert (REPO / script).is_file(), f"{command.where}: {script} is missing"
    help_text = subprocess.run(
        [sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    flags = [option.split("=")[0] for option in own if option.startswith("--")]
    missing = [flag for flag in flags if flag not in help_text]
    assert not missing, f"{command.where}: {script} --help has no {missing}"
    if forwarded:
        parse_loraplex([*SCRIPT_FORWARDS[script], *forwarded], capsys)


def check_click(command: Command, capsys) -> None:
    """Ray's click commands parse the line without running it; a config file it names
    is validated as Serve and loraplex read it."""
    module_name, group_name = CLICK_COMMANDS[command.program[0]].split(":")
    group = getattr(importlib.import_module(module_name), group_name)
    subcommand = group.get_command(None, command.program[1])
    assert subcommand is not None, (
        f"{command.where}: no `{command.program[0]} {command.program[1]}`"
    )
    subcommand.make_context(command.program[1], list(command.program[2:]))
    for config in [word for word in command.program[2:] if word.endswith((".yaml", ".yml"))]:
        validate_serve_config(REPO / config)


def validate_serve_config(path: Path) -> None:
    from ray.serve.schema import ServeDeploySchema

    from loraplex.deployments.config import PlatformConfig

    config = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(config)
    for app in config["applications"]:
        if app["import_path"].startswith("loraplex."):
            PlatformConfig.model_validate(app["args"])


def check_export(command: Command, capsys) -> None:
    names = [word.split("=")[0] for word in command.words[1:]]
    sources = "\n".join(
        path.read_text() for folder in PACKAGE_FOLDERS for path in (REPO / folder).rglob("*.py")
    )
    unread = [name for name in names if f'"{name}"' not in sources]
    assert not unread, f"{command.where}: the package reads no {unread}"


PARSERS = {
    "loraplex": check_loraplex,
    "bash": check_bash_script,
    "python": check_python,
    "ray": check_click,
    "serve": check_click,
    "export": check_export,
}
"""A command's program -> how its command line is checked without running it (curl has
no parser of ours: it runs against the session's app)."""


@pytest.mark.parametrize(
    "command",
    [command for command in all_commands() if command.program[0] in PARSERS],
    ids=lambda command: command.where,
)
def test_command_line_parses(command, capsys, monkeypatch):
    """Each command's parser; a `.venv/bin/` program must also be installed in the venv
    running the tests."""
    if command.words[0].startswith(".venv/bin/"):
        program = Path(sys.executable).parent / Path(command.words[0]).name
        assert program.exists(), f"{command.where}: {program} is not installed"
    monkeypatch.chdir(REPO)
    PARSERS[command.program[0]](command, capsys)


def test_app_commands_all_run_against_the_app():
    """What tests/deployments/test_docs_requests.py runs: every command it cannot parse
    here (curl) is one of them."""
    unparsed = [command for command in all_commands() if command.program[0] not in PARSERS]
    assert all(command in commands_run(APP) for command in unparsed)
