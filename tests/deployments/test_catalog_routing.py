"""Adapter catalog (tenant namespaces, path containment) and model routing with ACLs."""

from __future__ import annotations

import logging
import os

import pytest

from loraplex.deployments.catalog import CATALOG_FILE, AdapterCatalog, CatalogError
from loraplex.deployments.errors import OpenAIError
from loraplex.deployments.routing import resolve_model, visible_adapters
from loraplex.deployments.tenants import Tenant


def adapter_folder(path):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


@pytest.fixture
def catalog(tmp_path):
    shared = adapter_folder(tmp_path / "shared" / "french")
    root = tmp_path / "root"
    adapter_folder(root / "acme" / "mine")
    adapter_folder(root / "globex" / "secret")
    return AdapterCatalog(root, {"m1": {"french": str(shared)}})


def tenant(name, models=("*",), shared=()):
    return Tenant(name, frozenset(models), frozenset(shared))


def test_register_list_unload_delete(catalog):
    entry = catalog.register("acme", "m1", "mine", "mine", max_adapters=4)
    assert entry.public_id == "m1:mine" and entry.folder == catalog.root / "acme" / "mine"
    assert [e.public_id for e in catalog.tenant_entries("acme")] == ["m1:mine"]
    assert catalog.tenant_entries("globex") == []
    unloaded = catalog.unload("acme", "m1", "mine")
    assert unloaded.version > entry.version and unloaded.model_id != entry.model_id
    assert catalog.by_model_id("m1", entry.model_id) is None, "the old id is stale"
    assert catalog.by_model_id("m1", unloaded.model_id) == unloaded
    catalog.delete("acme", "m1", "mine")
    assert catalog.tenant_entries("acme") == []
    with pytest.raises(CatalogError, match="does not exist"):
        catalog.delete("acme", "m1", "mine")


def test_a_second_catalog_instance_sees_registrations(catalog):
    other = AdapterCatalog(catalog.root, {})
    catalog.register("acme", "m1", "mine", "mine", max_adapters=4)
    assert [e.name for e in other.tenant_entries("acme")] == ["mine"]


def test_a_second_instance_sees_an_update_written_within_the_same_mtime(catalog):
    """Two writes inside one tick of the file system's clock share an mtime: the other
    instance still sees the second (the file's inode and size are in its stamp), and
    `reread` reads the file whatever its stamp."""
    other = AdapterCatalog(catalog.root, {})
    first = catalog.register("acme", "m1", "mine", "mine", max_adapters=4)
    assert other.find("acme", "m1", "mine") == first
    before = (catalog.root / CATALOG_FILE).stat()
    second = catalog.unload("acme", "m1", "mine")
    os.utime(catalog.root / CATALOG_FILE, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert other.find("acme", "m1", "mine") == second
    third = catalog.unload("acme", "m1", "mine")
    os.utime(catalog.root / CATALOG_FILE, ns=(before.st_atime_ns, before.st_mtime_ns))
    other.reread()
    assert other.find("acme", "m1", "mine") == third


class Records(logging.Handler):
    """The catalog's warnings, caught at its own logger (a replica built in this process
    stops `loraplex.*` records from reaching the root logger)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def catalog_warnings():
    logger = logging.getLogger("loraplex.deployments.catalog")
    records = Records()
    logger.addHandler(records)
    yield records.messages
    logger.removeHandler(records)


def test_a_node_without_the_shared_root_says_so(catalog, tmp_path, catalog_warnings):
    entry = catalog.register("acme", "m1", "mine", "mine", max_adapters=4)
    assert AdapterCatalog(catalog.root, {}).by_model_id("m1", entry.model_id) == entry
    assert catalog_warnings == []
    unmounted = AdapterCatalog(tmp_path / "not-mounted", {})
    assert unmounted.by_model_id("m1", entry.model_id) is None
    root_missing, no_catalog = catalog_warnings
    assert f"adapter root {tmp_path / 'not-mounted'} did not exist" in root_missing
    assert f"{entry.model_id} asked for" in no_catalog and "mounted here" in no_catalog


@pytest.mark.parametrize(
    "path, message",
    [
        ("../globex/secret", "leaves your adapter root"),
        ("/etc", "must be relative"),
        ("mine/../../globex/secret", "leaves your adapter root"),
        ("missing", "not a directory"),
        (".", "leaves your adapter root"),
    ],
)
def test_paths_outside_the_tenant_root_are_refused(catalog, path, message):
    with pytest.raises(CatalogError, match=message) as error:
        catalog.register("acme", "m1", "x", path, max_adapters=4)
    assert error.value.status == 400


def test_symlinks_out_of_the_root_are_refused_even_after_registration(catalog, tmp_path):
    acme = catalog.root / "acme"
    os.symlink(catalog.root / "globex" / "secret", acme / "link")
    with pytest.raises(CatalogError, match="leaves your adapter root"):
        catalog.register("acme", "m1", "x", "link", max_adapters=4)
    sneaky = adapter_folder(acme / "sneaky")
    (sneaky / "adapter_model.safetensors").unlink()
    os.symlink("/etc/passwd", sneaky / "adapter_model.safetensors")
    with pytest.raises(CatalogError, match="link that leaves"):
        catalog.register("acme", "m1", "x", "sneaky", max_adapters=4)
    # Registered first, swapped for a link afterwards: the entry stops resolving.
    catalog.register("acme", "m1", "mine", "mine", max_adapters=4)
    os.rename(acme / "mine", acme / "mine-old")
    os.symlink(catalog.root / "globex" / "secret", acme / "mine")
    assert catalog.tenant_entries("acme") == []
    with pytest.raises(CatalogError):
        catalog.find_tenant("acme", "m1", "mine")


def test_adapter_quota(catalog):
    adapter_folder(catalog.root / "acme" / "second")
    catalog.register("acme", "m1", "mine", "mine", max_adapters=1)
    catalog.register("acme", "m1", "mine", "mine", max_adapters=1)
    with pytest.raises(CatalogError, match="may register 1") as error:
        catalog.register("acme", "m1", "second", "second", max_adapters=1)
    assert error.value.status == 403


def test_routing_applies_namespaces_and_acls(catalog):
    catalog.register("globex", "m1", "secret", "secret", max_adapters=4)
    catalog.register("acme", "m1", "mine", "mine", max_adapters=4)
    acme = tenant("acme", models=("m1",), shared=("m1:french",))
    bases = ["m1", "m2"]
    assert resolve_model(acme, "m1", bases, catalog).adapter is None
    assert resolve_model(acme, "m1:mine", bases, catalog).adapter.owner == "acme"
    assert resolve_model(acme, "mine", bases, catalog).adapter.public_id == "m1:mine"
    assert resolve_model(acme, "m1:french", bases, catalog).adapter.owner == "shared"
    assert resolve_model(acme, "french", bases, catalog).model_id.startswith("shared/")

    def status(model, who=acme):
        with pytest.raises(OpenAIError) as error:
            resolve_model(who, model, bases, catalog)
        return error.value.status, error.value.message

    # Another tenant's adapter looks exactly like one that does not exist.
    assert status("m1:secret") == status("m1:no-such-adapter")[0:1] + (
        "model 'm1:secret' does not exist",
    )
    assert status("secret")[0] == 404
    assert status("m2")[0] == 403
    assert status("m2:mine")[0] == 403
    assert status("m3")[0] == 404
    assert status("m1:french", tenant("other", shared=()))[0] == 403
    names = {e.public_id for e in visible_adapters(acme, bases, catalog)}
    assert names == {"m1:mine", "m1:french"}
