"""The `model` field -> (base model, adapter) for one tenant, with its ACL applied.

    "base"            the base model
    "base:adapter"    the tenant's own adapter on that base, else a shared one
    "adapter"         an adapter alias: a name unique among the adapters the tenant sees

Another tenant's adapters are outside the caller's namespace: naming one reads exactly
like naming an adapter that does not exist (404), so nothing can be probed. A base
model or shared adapter the tenant's ACL leaves out is a 403.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.deployments.catalog import AdapterCatalog, AdapterEntry, CatalogError
from loraplex.deployments.errors import OpenAIError
from loraplex.deployments.tenants import Tenant


@dataclass(frozen=True)
class Route:
    base: str
    adapter: AdapterEntry | None = None

    @property
    def model_id(self) -> str:
        """Serve multiplexed model id ('' for the base model)."""
        return self.adapter.model_id if self.adapter else ""


def _not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"model {model!r} does not exist", code="model_not_found")


def visible_adapters(
    tenant: Tenant, bases: list[str], catalog: AdapterCatalog
) -> list[AdapterEntry]:
    """The tenant's own adapters, then the shared ones its ACL allows."""
    own = [e for e in catalog.tenant_entries(tenant.name) if tenant.may_use_base(e.base)]
    shared = [
        entry
        for base in bases
        for entry in catalog.shared.get(base, {}).values()
        if tenant.may_use_shared(base, entry.name)
    ]
    return own + shared


def resolve_model(tenant: Tenant, model: str, bases: list[str], catalog: AdapterCatalog) -> Route:
    """Raises OpenAIError 404 / 403 / 400 when the tenant may not use `model`."""
    if ":" in model:
        base, _, name = model.partition(":")
        if base not in bases:
            raise _not_found(model)
        if not tenant.may_use_base(base):
            raise OpenAIError(403, f"you may not use model {base!r}", code="model_not_allowed")
        try:
            own = catalog.find_tenant(tenant.name, base, name)
        except CatalogError as exc:
            raise OpenAIError(400, f"adapter {model!r} cannot be loaded: {exc}") from None
        if own is not None:
            return Route(base, own)
        shared = catalog.find_shared(base, name)
        if shared is None:
            raise _not_found(model)
        if not tenant.may_use_shared(base, name):
            raise OpenAIError(403, f"you may not use adapter {model!r}", code="model_not_allowed")
        return Route(base, shared)
    if model in bases:
        if not tenant.may_use_base(model):
            raise OpenAIError(403, f"you may not use model {model!r}", code="model_not_allowed")
        return Route(model)
    matches = [e for e in visible_adapters(tenant, bases, catalog) if e.name == model]
    if not matches:
        raise _not_found(model)
    if len({e.public_id for e in matches}) > 1:
        choices = ", ".join(sorted({e.public_id for e in matches}))
        raise OpenAIError(400, f"adapter alias {model!r} is ambiguous: use one of {choices}")
    return Route(matches[0].base, matches[0])
