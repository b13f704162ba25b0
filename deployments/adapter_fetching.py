"""Registration by URI, in the ingress: the tenant's source for the URI, the fetch on
the ingress's own fetch threads (at most `MAX_CONCURRENT_FETCHES` per ingress replica,
so a slow download holds neither the event loop nor the threads that validation and
the catalog use), errors as OpenAI error JSON, and the fetched folders' eviction after
each registration (adapters/fetch.py, adapters/sources.py)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loraplex.adapters.fetch import AdapterFetcher, FetchedAdapter, FetchError, FetchLimits
from loraplex.adapters.sources import SourceError, parse_adapter_uri, source_for
from loraplex.deployments.catalog import AdapterCatalog
from loraplex.deployments.errors import OpenAIError
from loraplex.deployments.tenants import Tenant

logger = logging.getLogger(__name__)

MAX_CONCURRENT_FETCHES = 4
RETRY_AFTER_S = 5


class AdapterFetching:
    def __init__(self, limits: FetchLimits, catalog: AdapterCatalog) -> None:
        self.fetcher = AdapterFetcher(limits)
        self.catalog = catalog
        self._threads = ThreadPoolExecutor(MAX_CONCURRENT_FETCHES, "adapter-fetch")

    async def fetch(self, tenant: Tenant, uri_text: str) -> tuple[FetchedAdapter, str]:
        """The adapter at `uri_text` in the tenant's root, and the URI's display form;
        403 outside the tenant's sources, the fetch's own status when it fails."""
        try:
            uri = parse_adapter_uri(uri_text)
            access = source_for(uri, tenant.adapter_sources).access()
        except SourceError as exc:
            raise OpenAIError(exc.status, str(exc), param="uri") from None
        loop = asyncio.get_running_loop()
        root = self.catalog.tenant_root(tenant.name)
        try:
            fetched = await loop.run_in_executor(
                self._threads, self.fetcher.fetch, root, uri, access
            )
        except FetchError as exc:
            retry = RETRY_AFTER_S if exc.status in (409, 503) else None
            raise OpenAIError(exc.status, str(exc), code=exc.code, retry_after_s=retry) from None
        return fetched, uri.display

    async def evict(self) -> None:
        """Drops fetched folders no adapter uses past the cache size (errors logged)."""
        loop = asyncio.get_running_loop()
        try:
            in_use = await loop.run_in_executor(self._threads, self.catalog.fetched_in_use)
            await loop.run_in_executor(
                self._threads, self.fetcher.evict, Path(self.catalog.root), in_use
            )
        except OSError as exc:
            logger.warning("evicting fetched adapter folders failed: %r", exc)
