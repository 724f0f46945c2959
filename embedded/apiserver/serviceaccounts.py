"""kube-controller-manager's ServiceAccounts controller, built into the local API server: every active namespace
has a `default` ServiceAccount, made when the namespace is and made again when it is deleted.

Owns reacting to the store's changes (a namespace added, a `default` ServiceAccount deleted) with a create on
the event loop's next turn (a store listener may not write), and the sweep over existing namespaces at start.
Tokens for these accounts come from the TokenRequest API (`kubectl create token default`), as on 1.24+.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from embedded.apiserver import errors
from embedded.apiserver.storage import Change
from shared.logs import get_logger

log = get_logger(__name__)
DEFAULT = "default"
NAMESPACES = ("", "namespaces")
SERVICE_ACCOUNTS = ("", "serviceaccounts")


class ServiceAccountsController:
    def __init__(self, core: Any) -> None:
        self.core = core
        self._pending: set[str] = set()
        self._scheduled = False
        core.store.add_listener(self._changed)

    def _changed(self, change: Change) -> None:
        if change.res == NAMESPACES and change.type == "ADDED":
            self._want(change.key[1])
        elif change.res == SERVICE_ACCOUNTS and change.type == "DELETED" and change.key[1] == DEFAULT:
            self._want(change.key[0])

    def _want(self, namespace: str) -> None:
        self._pending.add(namespace)
        if self._scheduled:
            return
        with contextlib.suppress(RuntimeError):  # no loop yet: start() sweeps every namespace
            asyncio.get_running_loop().call_soon(self.sync)
            self._scheduled = True

    def start(self) -> None:
        """Every namespace that exists now (a server started on an old data dir)."""
        self._pending |= {key[1] for key, _ in self.core.store.items(NAMESPACES)}
        self.sync()

    def sync(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, set()
        ns_res = self.core.registry.by_key(*NAMESPACES)
        sa_res = self.core.registry.by_key(*SERVICE_ACCOUNTS)
        for namespace in sorted(pending):
            ns = self.core.store.get(NAMESPACES, ("", namespace))
            if ns is None or (ns.get("metadata") or {}).get("deletionTimestamp") or ns_res is None or sa_res is None:
                continue
            if self.core.store.get(SERVICE_ACCOUNTS, (namespace, DEFAULT)) is not None:
                continue
            try:
                self.core.create(sa_res, "v1", namespace, {"metadata": {"name": DEFAULT}})
            except errors.ApiError as err:  # the namespace went away meanwhile, or it is being deleted
                log.info("default ServiceAccount not made", namespace=namespace, reason=err.message)
