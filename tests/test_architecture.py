"""The package's seams, checked from its source (ast, nothing imported):

- the tooling (benchmarks, checks, probes, the CLI) lives in tools/, which the runtime
  packages never import, and no runtime module is a benchmark, a check or a probe;
- the dependency direction deployments -> platform -> (adapters, kernels): kernels
  import nothing of loraplex but their own package, adapters nothing of the platform
  but its config module, the platform nothing of deployments or Ray Serve, and the
  packages form no import cycle (every import counts, inside functions too);
- the platform's floors: no module imports a floor above its own;
- docs/ARCHITECTURE.md names every package module, and every module it names exists;
- each rule written in one place (one rank builder among them), one host LRU of
  adapters, constructors that construct, and no production branch on being under test.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("platform", "adapters", "kernels", "deployments")
PACKAGES = (*RUNTIME, "tools")
DOCUMENTED = (*PACKAGES, "_loraplex")
"""Folders whose every module docs/ARCHITECTURE.md names (`_loraplex/` is the
`loraplex` package itself)."""
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
PLATFORM_CONFIG = "loraplex.platform.config"


def package_modules() -> dict[str, Path]:
    """loraplex module name -> source file, for every module of the packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules["loraplex." + ".".join(parts)] = path
    return modules


def imports_of(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import statement in the file, relative
    imports resolved; `from a import b` yields a.b when that is a module, else a."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno
            yield base, node.lineno


MODULES = package_modules()


def resolve(name: str) -> str:
    """The longest prefix of `name` that is a loraplex module or package (or `name`)."""
    parts = name.split(".")
    for end in range(len(parts), 1, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES or any(m.startswith(candidate + ".") for m in MODULES):
            return candidate
    return name


def node_of(module: str) -> str | None:
    """The layer a loraplex module belongs to; the platform's config module is its own
    layer (adapters may read it)."""
    if module == PLATFORM_CONFIG:
        return "platform.config"
    for package in PACKAGES:
        if module == f"loraplex.{package}" or module.startswith(f"loraplex.{package}."):
            return package
    return None


def edges() -> list[tuple[str, str, str, int]]:
    """(importing module, imported module, file, line) for every import of the packages."""
    found = []
    for module, path in MODULES.items():
        for name, line in imports_of(module, path):
            found.append((module, resolve(name), str(path.relative_to(ROOT)), line))
    return found


EDGES = edges()


def violations(source_layer: str, forbidden) -> list[str]:
    return sorted(
        {
            f"{where}:{line} imports {target}"
            for module, target, where, line in EDGES
            if node_of(module) == source_layer and forbidden(target)
        }
    )


def test_the_walk_sees_the_imports_it_checks():
    """The checks below are only as good as this walk: it must see top-level and
    function-level imports and resolve `from package import module`."""
    targets = {(m, t) for m, t, _, _ in EDGES}
    assert ("loraplex.platform.engine", "loraplex.platform.scheduler") in targets
    assert ("loraplex.kernels.lora", "loraplex.kernels.cpu_ops") in targets
    assert ("loraplex.deployments.ingress", "ray.serve.handle") in {
        (m, t) for m, t, _, _ in EDGES if t.startswith("ray.serve")
    }
    assert node_of(PLATFORM_CONFIG) == "platform.config"


def test_kernels_import_only_their_own_package():
    bad = violations(
        "kernels",
        lambda t: t.startswith("loraplex") and not t.startswith("loraplex.kernels"),
    )
    assert bad == []


def test_adapters_read_only_the_platform_config():
    def forbidden(target: str) -> bool:
        layer = node_of(target)
        return layer in ("platform", "deployments") or target == "loraplex"

    assert violations("adapters", forbidden) == []


def test_platform_knows_no_deployments_and_no_ray_serve():
    def forbidden(target: str) -> bool:
        is_serve = target == "ray.serve" or target.startswith("ray.serve.")
        return node_of(target) == "deployments" or is_serve

    assert violations("platform", forbidden) == []


def test_the_runtime_never_imports_the_tooling():
    """Serving and building an engine run no benchmark or probe: nothing in the four
    runtime packages imports tools/ (the `dtype: auto` record is only read)."""
    found = [v for layer in (*RUNTIME, "platform.config") for v in violations(layer, is_tooling)]
    assert found == []


def is_tooling(target: str) -> bool:
    return target == "loraplex.tools" or target.startswith("loraplex.tools.")


TOOLING_NAME = re.compile(r"(^|_)(bench|benchmark|check|probe)s?($|_)")


def test_the_tooling_lives_outside_the_runtime_packages():
    tooling = sorted(
        module
        for module in MODULES
        if node_of(module) in (*RUNTIME, "platform.config")
        and any(TOOLING_NAME.search(part) for part in module.split(".")[2:])
    )
    assert tooling == []
    assert violations("platform", is_tooling) == [] and is_tooling("loraplex.tools.cli")
    assert TOOLING_NAME.search("host_bench") and TOOLING_NAME.search("gemm_probe")
    assert not TOOLING_NAME.search("checkpoint")


def test_no_import_cycle_between_the_packages():
    graph: dict[str, set[str]] = {}
    for module, target, _, _ in EDGES:
        source, sink = node_of(module), node_of(target)
        if source and sink and source != sink:
            graph.setdefault(source, set()).add(sink)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle between packages: {' -> '.join(cycle)}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that returns to its start, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


MODULE_PATH = re.compile(
    r"`((?:platform|adapters|kernels|deployments|tools|_loraplex)/[\w/]*\.py)`"
)


def documented_paths() -> set[str]:
    return set(MODULE_PATH.findall(ARCHITECTURE.read_text()))


def test_architecture_names_every_package_module():
    named = documented_paths()
    modules = [path for folder in DOCUMENTED for path in sorted((ROOT / folder).rglob("*.py"))]
    missing = sorted(
        str(path.relative_to(ROOT)) for path in modules if str(path.relative_to(ROOT)) not in named
    )
    assert missing == [], f"modules missing from docs/ARCHITECTURE.md: {missing}"


def test_every_module_the_architecture_names_exists():
    ghosts = sorted(path for path in documented_paths() if not (ROOT / path).is_file())
    assert ghosts == [], f"docs/ARCHITECTURE.md names modules that do not exist: {ghosts}"


@pytest.mark.parametrize("text", ["`platform/engine.py`", "`_loraplex/cli.py` is"])
def test_the_architecture_path_pattern_matches(text):
    assert MODULE_PATH.search(text)


WRITTEN_ONCE = {
    "the stop rule": (r"def check_stop\(", "platform/stop.py"),
    "the chat template": (r"\.apply_chat_template\(", "platform/tokenizer.py"),
    "the adapter-name rule": (r"ADAPTER_NAME = re\.compile", "adapters/store.py"),
    "the LoRA backends": (r"def add_lora\(", "kernels/backends.py"),
    "the LoRA slot layout": (r"def lora_stack\(", "kernels/backends.py"),
    "the kernel family choice": (
        r"def select_backend\(|def kernel_backend\(",
        "kernels/selection.py",
    ),
    "the step every rank runs": (r"\.compute_logits\(", "platform/model_runner.py"),
    "fitting max_tokens to a request's limits": (
        r"replace\(\s*params,\s*max_tokens=",
        "platform/request_limits.py",
    ),
    "a request's worst case": (r"params\.n \* params\.max_tokens", "platform/request_limits.py"),
    "how a rank is built": (
        r"(?<!def )(load_model|allocate_kv_caches)\(|ModelRunner\(",
        "platform/rank_builder.py",
    ),
}
"""Each rule of the architecture, the pattern that writes it, and the one file that may."""


@pytest.mark.parametrize("rule", sorted(WRITTEN_ONCE))
def test_each_rule_is_written_in_one_place(rule):
    pattern, owner = WRITTEN_ONCE[rule]
    sources = [
        path for folder in (*DOCUMENTED, "scripts") for path in (ROOT / folder).rglob("*.py")
    ]
    writers = sorted(
        str(path.relative_to(ROOT)) for path in sources if re.search(pattern, path.read_text())
    )
    assert writers == [owner], f"{rule} is written in {writers}, expected only in {owner}"


PLATFORM_FLOORS = (
    ("loraplex.platform.arch",),
    ("loraplex.platform.layers", "loraplex.platform.parallel"),
    ("loraplex.platform.models",),
)
"""The platform's lower floors, bottom first: the model's shape; layers and the
tensor-parallel primitives; the models built from them. Every other platform module is
on the floor above (the KV cache, the runner, the rank builder, the engine...)."""


def platform_floor(module: str) -> int | None:
    """A platform module's floor (None outside the platform)."""
    if node_of(module) not in ("platform", "platform.config"):
        return None
    for floor, prefixes in enumerate(PLATFORM_FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return floor
    return len(PLATFORM_FLOORS)


def test_no_upward_import_inside_the_platform():
    upward = sorted(
        f"{where}:{line} imports {target}"
        for module, target, where, line in EDGES
        if platform_floor(target) is not None
        and platform_floor(module) is not None
        and platform_floor(target) > platform_floor(module)
    )
    assert upward == []


def test_platform_floor_sees_each_floor():
    assert platform_floor("loraplex.platform.arch") == 0
    assert platform_floor("loraplex.platform.parallel.group") == 1
    assert platform_floor("loraplex.platform.models.llama") == 2
    assert platform_floor("loraplex.platform.engine") == 3
    assert platform_floor("loraplex.kernels.lora") is None


def test_constructors_construct():
    """No object is made around its constructor (`cls.__new__` then a setup method)."""
    sources = [
        path for folder in (*DOCUMENTED, "scripts") for path in (ROOT / folder).rglob("*.py")
    ]
    bypasses = sorted(
        str(path.relative_to(ROOT)) for path in sources if "__new__(" in path.read_text()
    )
    assert bypasses == []


TEST_BRANCH = re.compile(r"\bpytest\b|PYTEST_|_in_serve\b|\bunder_test\b|\bin_tests?\b")


def test_no_production_module_branches_on_being_under_test():
    """Test seams are injected (a `LocalPlace`, failpoints armed through an API, config
    options a user has too), never read from the environment a test runs in."""
    sources = [path for folder in (*RUNTIME, "_loraplex") for path in (ROOT / folder).rglob("*.py")]
    branching = sorted(
        str(path.relative_to(ROOT)) for path in sources if TEST_BRANCH.search(path.read_text())
    )
    assert branching == []
    assert TEST_BRANCH.search("os.environ.get('PYTEST_CURRENT_TEST')")
    assert TEST_BRANCH.search("if _in_serve():") and not TEST_BRANCH.search("latest")


def test_one_host_lru_for_adapters():
    """The engine's adapter store is a replica's only host cache of adapters: Serve's
    multiplexed cache (a second LRU) is not used."""
    sources = [path for folder in RUNTIME for path in (ROOT / folder).rglob("*.py")]
    users = sorted(
        str(path.relative_to(ROOT)) for path in sources if "serve.multiplexed" in path.read_text()
    )
    assert users == []


def test_the_scheduler_is_fcfs_plus_policy_hooks():
    """platform/scheduler.py stays small and policy-free (who goes first is
    platform/scheduling_policy.py's), and it alone writes its requests."""
    source = (ROOT / "platform" / "scheduler.py").read_text()
    assert len(source.splitlines()) <= 400
    assert "fair_share" not in source and "FairShare" not in source
    sources = [path for folder in DOCUMENTED for path in (ROOT / folder).rglob("*.py")]
    writers = sorted(
        str(path.relative_to(ROOT))
        for path in sources
        if re.search(r"scheduler\.requests\[[^\]]+\]\.", path.read_text())
    )
    assert writers == []


def test_the_async_engine_uses_the_engines_api_only():
    """AsyncEngine (and the serving layer through it) calls LLMEngine's methods: no reach
    into its runner, KV cache, scheduler, adapter store or output processor."""
    reaches = re.compile(r"\bengine\.(runner|kv_cache|scheduler|adapters|outputs)\b")
    sources = [ROOT / "platform" / "async_engine.py", *(ROOT / "deployments").rglob("*.py")]
    found = sorted(
        f"{path.relative_to(ROOT)}:{number}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if reaches.search(line)
    )
    assert found == []
