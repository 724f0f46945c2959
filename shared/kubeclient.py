"""The one way a service gets its Kubernetes client: in-cluster credentials or a kubeconfig file."""

from __future__ import annotations

import os
from typing import Any


async def kube_api_client(kubeconfig: str = "") -> Any:
    """A kubernetes-asyncio ApiClient: in-cluster credentials when no kubeconfig is given and the
    process runs in a pod, else the kubeconfig file (`KUBECONFIG` / `~/.kube/config` when empty).
    The caller closes it (`async with`, or `await api.close()`)."""
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    if not kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        await config.load_kube_config(config_file=kubeconfig or None, client_configuration=configuration)
    return client.ApiClient(configuration)
