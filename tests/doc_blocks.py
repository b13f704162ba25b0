"""The fenced code blocks of README.md and docs/*.md, and how the doc tests run each.

Shared by tests/test_docs.py (everything that runs without Ray) and
tests/deployments/test_docs_requests.py (what needs the session's Serve app).

A block's language decides what it is. `bash`, `python`, `yaml` and `json` blocks are
code and must be covered: a python, yaml or json block by an entry in `BLOCKS` (found by
its file and the start of its first line), every command of a bash block by a rule in
`COMMANDS` (found by its leading words). Untagged and `text` blocks are diagrams and
printed output: text to read, not code to run. Any other language is an error until it
is given a place here.

Blocks written for the default model and the demo app (`serve run serve_config.yaml`)
run on the tests' tiny models and the session's app: `SUBSTITUTIONS` lists every text
a block has replaced before it runs, and `REDUCTIONS` the options appended to a
command so it runs in seconds; nothing else is changed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = ("README.md", "docs/*.md")
CODE_LANGUAGES = ("bash", "python", "yaml", "json")
TEXT_LANGUAGES = ("", "text")
"""Untagged blocks (docs/ARCHITECTURE.md's diagram, the README's layout, printed output)
and `text` blocks (printed output) are not code: nothing runs them."""

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<marker>```+|~~~+)[ \t]*(?P<language>[\w+-]*)")

# How a block or a command is covered, as the doc tests' report names it.
EXECUTED = "executed"
REDUCED = "executed reduced"
PARSED = "parsed only"
NOT_COVERED = "NOT COVERED"

# Where it runs: here without Ray (tests/test_docs.py), against the session's app
# (tests/deployments/test_docs_requests.py), or nowhere (its command line is parsed).
ENGINE = "engine"
APP = "app"
NOWHERE = "parse"


@dataclass(frozen=True)
class CodeBlock:
    path: str
    line: int
    language: str
    text: str

    @property
    def first_line(self) -> str:
        return next((line for line in self.text.splitlines() if line.strip()), "")

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_paths() -> list[Path]:
    return sorted(path for pattern in DOC_FILES for path in REPO.glob(pattern))


def fenced_blocks(path: Path, root: Path = REPO) -> Iterator[CodeBlock]:
    """Every fenced block of a Markdown file, dedented by its fence's indent (named by
    its path under `root`)."""
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        index += 1
        if opening is None:
            continue
        fence_line = index
        indent, marker = opening["indent"], opening["marker"]
        body = []
        while index < len(lines) and not lines[index].strip().startswith(marker):
            line = lines[index]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            index += 1
        if index == len(lines):
            raise ValueError(f"{path}:{fence_line}: unclosed code fence")
        index += 1
        yield CodeBlock(
            str(path.relative_to(root)), fence_line, opening["language"].lower(), "\n".join(body)
        )


def doc_blocks() -> list[CodeBlock]:
    return [block for path in doc_paths() for block in fenced_blocks(path)]


def code_blocks(language: str | None = None) -> list[CodeBlock]:
    return [
        block
        for block in doc_blocks()
        if block.language in CODE_LANGUAGES and language in (None, block.language)
    ]


# ---- python, yaml and json blocks --------------------------------------------------


@dataclass(frozen=True)
class BlockCoverage:
    runs: str
    how: str
    reason: str = ""
    continues: tuple[str, str] | None = None
    """The BLOCKS key of an earlier block whose names this one uses: it runs first."""


BLOCKS: dict[tuple[str, str], BlockCoverage] = {
    ("README.md", "import openai"): BlockCoverage(APP, EXECUTED),
    ("README.md", "from loraplex.platform import LLM"): BlockCoverage(ENGINE, EXECUTED),
    ("docs/offline.md", "import tempfile"): BlockCoverage(
        ENGINE, EXECUTED, "a PEFT adapter with a resized vocabulary of the tests' tiny Llama"
    ),
    ("docs/serving.md", "import math"): BlockCoverage(
        APP,
        EXECUTED,
        "after the README's first-requests block (its client)",
        continues=("README.md", "import openai"),
    ),
    ("docs/benchmarks.md", "from loraplex.platform import LLM"): BlockCoverage(
        ENGINE, EXECUTED, "builds the engine"
    ),
    ("docs/benchmarks.md", "engine:"): BlockCoverage(
        ENGINE,
        EXECUTED,
        "merged into serve_config.yaml's model entry, parsed by deployments/config.py",
    ),
    ("docs/offline.md", "from loraplex.platform import LLM"): BlockCoverage(
        ENGINE, EXECUTED, "tiny PEFT adapters for the demo ones"
    ),
    ("docs/operations.md", '{"object": "residency"'): BlockCoverage(
        APP, EXECUTED, "its records' fields compared with the session app's residency answer"
    ),
    ("docs/operations.md", "deployments:"): BlockCoverage(
        APP,
        EXECUTED,
        "merged into serve_config.yaml, parsed by Serve's ServeDeploySchema; the "
        "deployment it names is one the session's app runs",
    ),
    ("docs/serving.md", "tenants:"): BlockCoverage(
        ENGINE,
        EXECUTED,
        "replaces serve_config.yaml's tenants, parsed by deployments/config.py; each "
        "source's storage options built",
    ),
    ("docs/serving.md", "schema = "): BlockCoverage(
        APP,
        EXECUTED,
        "after the README's first-requests block (its client and question)",
        continues=("README.md", "import openai"),
    ),
}


def block_coverage(block: CodeBlock) -> BlockCoverage | None:
    """The BLOCKS entry of a python, yaml or json block (None: not covered)."""
    entries = [
        coverage
        for (path, start), coverage in BLOCKS.items()
        if path == block.path and block.first_line.startswith(start)
    ]
    if len(entries) > 1:
        raise ValueError(f"{block.where}: more than one BLOCKS entry matches")
    return entries[0] if entries else None


def block_matching(path: str, start: str) -> CodeBlock:
    return next(
        block
        for block in code_blocks()
        if block.path == path and block.first_line.startswith(start)
    )


def block_script(block: CodeBlock) -> str:
    """A python block's script: the blocks it continues, then its own text."""
    continues = block_coverage(block).continues
    before = block_script(block_matching(*continues)) + "\n" if continues else ""
    return before + block.text + "\n"


def blocks_run(runs: str, language: str) -> list[CodeBlock]:
    return [
        block
        for block in code_blocks(language)
        if (coverage := block_coverage(block)) is not None and coverage.runs == runs
    ]


# ---- bash blocks: one rule per command ---------------------------------------------


@dataclass(frozen=True)
class Command:
    block: CodeBlock
    index: int
    words: tuple[str, ...]
    line: str
    """The logical line it came from (continuations joined), as bash runs it."""

    @property
    def program(self) -> tuple[str, ...]:
        """Its words with `.venv/bin/` dropped and python3 read as python."""
        first = Path(self.words[0]).name if self.words[0].startswith(".venv/") else self.words[0]
        return ("python" if first == "python3" else first, *self.words[1:])

    @property
    def where(self) -> str:
        return f"{self.block.where}#{self.index}"


@dataclass(frozen=True)
class CommandRule:
    program: tuple[str, ...]
    runs: str
    how: str
    reason: str


COMMANDS = (
    CommandRule(("loraplex", "generate"), ENGINE, REDUCED, "tiny model, 8 tokens"),
    CommandRule(("loraplex", "bench", "offline"), ENGINE, REDUCED, "tiny model, 2 x 16 -> 4"),
    CommandRule(("loraplex", "probe", "dtype"), ENGINE, REDUCED, "tiny model"),
    CommandRule(
        ("loraplex", "quantize"),
        NOWHERE,
        PARSED,
        "writes a checkpoint of the default model; tests/tools/test_quantize.py runs the "
        "same command on the tiny model",
    ),
    CommandRule(
        ("loraplex", "bench", "serve"), APP, REDUCED, "the session's app, 4 prompts, 8 -> 4"
    ),
    CommandRule(
        ("loraplex", "check"),
        NOWHERE,
        PARSED,
        "a suite of minutes against a running app; tests/deployments/test_fuzz.py, "
        "test_soak.py and test_load.py run the same suites reduced against the session's app",
    ),
    CommandRule(("curl",), APP, EXECUTED, "against the session's app"),
    CommandRule(
        ("bash", "scripts/install.sh"),
        NOWHERE,
        PARSED,
        "installs torch and the project into .venv (minutes, network); bash -n",
    ),
    CommandRule(
        ("bash", "scripts/bench_serve.sh"),
        NOWHERE,
        PARSED,
        "three apps, each a benchmark of minutes; bash -n",
    ),
    CommandRule(
        ("python", "scripts/bench_ab.py"),
        NOWHERE,
        PARSED,
        "benchmarks another commit against this one for minutes; its flags against "
        "--help, the forwarded ones by `loraplex bench offline`'s parser",
    ),
    CommandRule(
        ("python", "-m", "pytest"), NOWHERE, PARSED, "the whole suite (31 min); pytest present"
    ),
    CommandRule(
        ("serve", "run"),
        NOWHERE,
        PARSED,
        "serves in the foreground until Ctrl-C; Serve's CLI parses it, the config "
        "validates (the session's app is serve.run of the same build_app)",
    ),
    CommandRule(
        ("serve", "deploy"),
        NOWHERE,
        PARSED,
        "deploys onto a running cluster; Serve's CLI parses it, the config validates",
    ),
    CommandRule(("ray", "start"), NOWHERE, PARSED, "starts a cluster node; Ray's CLI parses it"),
    CommandRule(
        ("export",),
        NOWHERE,
        PARSED,
        "sets an environment variable; the package must read that variable",
    ),
)

CLICK_COMMANDS = {"ray": "ray.scripts.scripts:cli", "serve": "ray.serve.scripts:cli"}
"""Ray's own commands: the click group whose parser reads them."""

SCRIPT_FORWARDS = {"scripts/bench_ab.py": ("bench", "offline")}
"""Scripts whose options after `--` go to a `loraplex` command."""


def shell_commands(block: CodeBlock) -> list[Command]:
    """The commands of a bash block: one per logical line (backslash continuations and
    open quotes joined), split on `&&` and `;`; a pipeline is one command."""
    commands: list[Command] = []
    pending = ""
    for line in block.text.splitlines():
        pending = f"{pending}{line}\n"
        joined = pending.replace("\\\n", " ")
        if pending.rstrip().endswith(("\\", "|")):
            continue
        try:
            words = shlex.split(joined, comments=True)
        except ValueError:
            continue
        for part in split_words(words, ("&&", ";")):
            commands.append(Command(block, len(commands), tuple(part), joined.strip()))
        pending = ""
    if pending.strip():
        raise ValueError(f"{block.where}: unfinished command {pending!r}")
    return commands


def split_words(words: list[str], separators: tuple[str, ...]) -> list[list[str]]:
    parts: list[list[str]] = [[]]
    for word in words:
        if word in separators:
            parts.append([])
        else:
            parts[-1].append(word)
    return [part for part in parts if part]


def all_commands() -> list[Command]:
    return [command for block in code_blocks("bash") for command in shell_commands(block)]


def command_rule(command: Command) -> CommandRule | None:
    """The rule of the longest program prefix matching the command (None: uncovered)."""
    matches = [rule for rule in COMMANDS if command.program[: len(rule.program)] == rule.program]
    return max(matches, key=lambda rule: len(rule.program), default=None)


def commands_run(runs: str) -> list[Command]:
    return [
        command
        for command in all_commands()
        if (rule := command_rule(command)) is not None and rule.runs == runs
    ]


# ---- what a block or command runs on instead of the default model and demo app -----

SUBSTITUTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    # Engine blocks: the tests' tiny Llama and two tiny PEFT adapters of it.
    ENGINE: (
        ("smollm2-135m-instruct", "{tiny_model}"),
        ("adapters/demo/french", "{adapter_french}"),
        ("adapters/demo/pirate", "{adapter_pirate}"),
    ),
    # App blocks: the session's app (tests/deployments/conftest.py), its tenant acme's
    # key for the demo keys, its operator key, `tiny-bytes` (a byte-level tokenizer that
    # can spell JSON) with its adapter `sj` for the default model and `french`, and `sb`
    # (an adapter name unique in the app) for `pirate`.
    APP: (
        ("curl -s 127.0.0.1:8265/api/serve/applications/", "cat {serve_details}"),
        ("http://127.0.0.1:8000", "{url}"),
        ("127.0.0.1:8000", "{host_port}"),
        ("sk-loraplex-demo", "{tenant_key}"),
        ("sk-acme-demo", "{tenant_key}"),
        ("sk-loraplex-operator", "{operator_key}"),
        ("smollm2-135m-instruct:french", "tiny-bytes:sj"),
        ('"pirate"', '"sb"'),
        ("smollm2-135m-instruct", "tiny-bytes"),
    ),
}
"""Doc text -> what replaces it, in order. The dashboard's `/api/serve/applications/`
(the session's app runs without a dashboard) is read from Serve's controller, the same
JSON the dashboard serves."""


ENGINE_MACHINE_BYTES = 256 << 20
"""Engine blocks and commands run as on a machine of 256 MiB: the engine's default KV
cache (a tenth of the machine's memory) is then 26 MiB instead of gigabytes to zero
and, for the tiny model, hundreds of thousands of blocks to book."""

SMALL_MACHINE = (
    "import loraplex.platform.kv_cache\n"
    f"loraplex.platform.kv_cache.device_memory_bytes = lambda device: {ENGINE_MACHINE_BYTES}\n"
)
"""What an engine python block's script starts with (ENGINE_MACHINE_BYTES)."""


def substitute(text: str, runs: str, values: dict[str, str]) -> str:
    for doc_text, replacement in SUBSTITUTIONS[runs]:
        text = text.replace(doc_text, replacement.format(**values))
    return text


@dataclass(frozen=True)
class Reduction:
    always: str
    """Options appended to every such command (argparse keeps the last value)."""
    when_given: str = ""
    """Options appended only where the doc's command gives them (lower values)."""


REDUCTIONS = {
    ("generate",): Reduction("--model {tiny_model} --dtype float32 --max-tokens 8"),
    ("bench", "offline"): Reduction(
        "--model {tiny_model} --dtype float32 --num-requests 2 --prompt-len 16 "
        "--output-len 4 --rounds 1",
        when_given="--adapters 2",
    ),
    ("probe", "dtype"): Reduction("--model {tiny_model}"),
    ("bench", "serve"): Reduction(
        "--url {url} --model tiny-bytes --tokenizer {byte_tokenizer} --num-prompts 4 "
        "--max-concurrency 4 --prompt-len 8 --output-len 4"
    ),
}
"""`loraplex` subcommand -> what makes it run in seconds on the tests' tiny models."""


def reduced_argv(argv: list[str], values: dict[str, str]) -> list[str]:
    """A `loraplex` command line (without `loraplex`) with its reduction appended."""
    reduction = next(
        (found for words, found in REDUCTIONS.items() if tuple(argv[: len(words)]) == words),
        None,
    )
    if reduction is None:
        raise KeyError(f"no REDUCTIONS entry for `loraplex {' '.join(argv)}`")
    given = reduction.when_given.split()
    lowered = [
        word
        for pair in zip(given[::2], given[1::2], strict=True)
        if pair[0] in argv
        for word in pair
    ]
    return [*argv, *(word.format(**values) for word in (*reduction.always.split(), *lowered))]


def coverage_rows() -> list[tuple[str, str, str, str]]:
    """(file:line, language, how, why) for every code block, one row per bash command."""
    rows = []
    for block in code_blocks():
        if block.language == "bash":
            for command in shell_commands(block):
                rule = command_rule(command)
                how, why = (rule.how, rule.reason) if rule else (NOT_COVERED, "no COMMANDS rule")
                rows.append(
                    (command.where, "bash", how, f"`{' '.join(command.words)[:60]}`: {why}")
                )
        else:
            coverage = block_coverage(block)
            how, why = (
                (coverage.how, coverage.reason) if coverage else (NOT_COVERED, "no BLOCKS entry")
            )
            rows.append((block.where, block.language, how, why))
    return rows


BLOCK_TIMEOUT_S = 120
SUITE_SWITCHES = ("TRITON_INTERPRET", "LORAPLEX_TEST_DEVICE")
"""Environment the suite sets for itself (tests/conftest.py) that a user's run lacks."""


def run_in_shell(argv: list[str]) -> subprocess.CompletedProcess:
    """Runs a block's program from the repository root, in this interpreter's
    environment as a user has it: without the switches tests/conftest.py sets."""
    env = {name: value for name, value in os.environ.items() if name not in SUITE_SWITCHES}
    return subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
    )


def run_python(code: str) -> subprocess.CompletedProcess:
    """Runs a python block as a script (see `run_in_shell`)."""
    return run_in_shell([sys.executable, "-c", code])
