"""The ingress process runs no torch: it parses requests and engine options, validates
adapter registrations (numpy only, adapters/peft_format.validate_peft_adapter) and
streams answers, and leaves every tensor to the model replicas."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from http_calls import api_call
from safetensors.torch import load_file, save_file

from loraplex.tools.check import processes

APP = "loraplex"
PREFIX = "base_model.model.model.layers"


def _maps_torch(pid: int) -> bool:
    """Whether the process has any of torch's shared libraries mapped."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "libtorch" in maps or "/torch/lib/" in maps


def test_importing_the_ingress_imports_no_torch():
    probe = (
        "import sys\n"
        "import loraplex.deployments.ingress\n"
        "import loraplex.deployments.proxy_middleware\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_ingress_replica_validates_adapters_without_loading_torch(
    serve_setup, tenant_keys, peft_adapter_factory
):
    root = serve_setup.adapter_root / "acme"
    good = peft_adapter_factory(serve_setup.base, root / "no-torch" / "good", rank=4, seed=31)
    bad = Path(shutil.copytree(good, root / "no-torch" / "bad"))
    weights = bad / "adapter_model.safetensors"
    tensors = load_file(weights)
    b_name = next(name for name in tensors if name.endswith("lora_B.weight"))
    tensors[b_name][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})

    key = tenant_keys["acme"]
    url = serve_setup.url
    register = {"model": "tiny", "name": "no-torch", "path": "no-torch/good"}
    status, body, _ = api_call(url, key, "POST", "/v1/adapters", register)
    assert status == 201, body
    assert api_call(url, key, "DELETE", "/v1/adapters/tiny/no-torch")[0] == 200
    register = {"model": "tiny", "name": "no-torch-bad", "path": "no-torch/bad"}
    status, body, _ = api_call(url, key, "POST", "/v1/adapters", register)
    assert status == 400, body
    assert "contains NaN or Inf" in body["error"]["message"]

    ingresses = processes.find(processes.replica_title(APP, "OpenAIIngress"))
    assert ingresses, "no ingress replica process found"
    for ingress in ingresses:
        assert not _maps_torch(ingress.pid), f"ingress {ingress.pid} has torch loaded"
