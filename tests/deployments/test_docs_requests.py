"""The doc blocks that need a running app (tests/doc_blocks.py: those that run on `APP`),
run against the session's Serve app with SUBSTITUTIONS[APP]: the README's and
docs/serving.md's python (in a subprocess), every curl command (in bash), `loraplex bench
serve` (in-process, with REDUCTIONS), the residency answer docs/operations.md prints
and the logging override it shows. tests/test_docs.py runs the rest.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.request

import pytest
import yaml
from doc_blocks import (
    APP,
    REPO,
    Command,
    block_script,
    blocks_run,
    commands_run,
    reduced_argv,
    run_in_shell,
    run_python,
    substitute,
)

from loraplex.cli import main as loraplex_main

logger = logging.getLogger(__name__)
RESIDENCY_WAIT_S = 15.0
OPENAI_ERROR = re.compile(r'"error"\s*:\s*\{')


def serve_details() -> dict:
    """What the dashboard's /api/serve/applications/ answers: the controller's details."""
    from ray.serve.context import _get_global_client

    return _get_global_client().get_serve_details()


@pytest.fixture(scope="module")
def app_values(serve_setup, tenant_keys, operator_key, tiny_model_factory, tmp_path_factory):
    """What SUBSTITUTIONS[APP] and REDUCTIONS put in a block: the session's app, acme's
    key, the operator key, the tokenizer of `tiny-bytes`, and the controller's details
    as the dashboard would serve them."""
    details = tmp_path_factory.mktemp("doc-app") / "serve_applications.json"
    details.write_text(json.dumps(serve_details()))
    byte_model = tiny_model_factory("llama", tokenizer="bytes", max_position_embeddings=1024)
    return {
        "url": serve_setup.url,
        "host_port": serve_setup.url.removeprefix("http://"),
        "tenant_key": tenant_keys["acme"],
        "operator_key": operator_key,
        "byte_tokenizer": str(byte_model),
        "serve_details": str(details),
    }


@pytest.mark.parametrize("block", blocks_run(APP, "python"), ids=lambda block: block.where)
def test_app_python_block_runs(block, app_values):
    code = substitute(block_script(block), APP, app_values)
    done = run_python(code)
    logger.info("%s printed:\n%s", block.where, done.stdout)
    assert done.returncode == 0, f"{block.where} failed:\n{done.stderr[-3000:]}"


def run_bash(command: Command, values: dict[str, str]) -> str:
    line = substitute(command.line, APP, values)
    done = run_in_shell(["bash", "-o", "pipefail", "-c", line])
    logger.info("%s: %s\n%s", command.where, line, done.stdout)
    assert done.returncode == 0, f"{command.where}: `{line}` -> {done.returncode}: {done.stderr}"
    return done.stdout


def run_loraplex(command: Command, values: dict[str, str], capsys) -> str:
    words = [substitute(word, APP, values) for word in command.words[1:]]
    argv = reduced_argv(words, values)
    code = loraplex_main(argv)
    out = capsys.readouterr().out
    logger.info("loraplex %s\n%s", " ".join(argv), out)
    assert code == 0, f"{command.where}: `loraplex {' '.join(argv)}` -> {code}:\n{out}"
    return out


@pytest.mark.parametrize("command", commands_run(APP), ids=lambda command: command.where)
def test_app_command_runs(command, app_values, capsys):
    """curl commands and pipelines in bash, `loraplex` in-process; an OpenAI error in the
    answer (curl -s exits 0 on a 4xx) fails too."""
    if command.program[0] == "loraplex":
        out = run_loraplex(command, app_values, capsys)
    else:
        out = run_bash(command, app_values)
    assert out.strip(), f"{command.where} printed nothing"
    assert not OPENAI_ERROR.search(out), f"{command.where} answered an error: {out[:2000]}"


def get_json(url: str, key: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def record_fields(value, path: str = "") -> dict[str, set[str]]:
    """The fields of each record in a JSON answer: the top object and every object in a
    list, by its list's path (objects that map names to counts are data, not records)."""
    fields: dict[str, set[str]] = {}
    if isinstance(value, dict):
        fields[path or "."] = set(value)
        for key, item in value.items():
            if isinstance(item, list):
                for element in item:
                    for sub_path, names in record_fields(element, f"{path}.{key}").items():
                        fields.setdefault(sub_path, set()).update(names)
    return fields


def residency_with_replicas(values: dict[str, str], model: str) -> dict:
    """The residency answer for `model` once a replica of it has reported."""
    url = f"{values['url']}/v1/admin/residency?model={model}"
    deadline = time.monotonic() + RESIDENCY_WAIT_S
    while True:
        answer = get_json(url, values["operator_key"])
        if answer["data"] and answer["data"][0]["replicas"] or time.monotonic() > deadline:
            return answer
        time.sleep(0.5)


@pytest.mark.parametrize("block", blocks_run(APP, "json"), ids=lambda block: block.where)
def test_app_json_block_has_the_answers_fields(block, app_values):
    """The printed residency answer: its records carry exactly the real answer's fields."""
    printed = json.loads(block.text)
    model = substitute(printed["data"][0]["model"], APP, app_values)
    answer = residency_with_replicas(app_values, model)
    assert answer["data"][0]["replicas"], f"no replica of {model} reported its residency"
    assert record_fields(printed) == record_fields(answer), block.where


@pytest.mark.parametrize("block", blocks_run(APP, "yaml"), ids=lambda block: block.where)
def test_app_yaml_block_configures_the_app(block, serve_setup):
    """Added to serve_config.yaml's loraplex application, Serve's schema accepts it, and
    each deployment it names is one the app runs."""
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    application = next(app for app in config["applications"] if app["name"] == "loraplex")
    addition = yaml.safe_load(block.text)
    for key, value in addition.items():
        if isinstance(value, list):
            application.setdefault(key, []).extend(value)
        else:
            application[key] = value
    ServeDeploySchema.model_validate(config)
    running = set(serve_details()["applications"]["loraplex"]["deployments"])
    named = {deployment["name"] for deployment in addition["deployments"]}
    assert named <= running, f"{block.where}: the app runs no {named - running}"
