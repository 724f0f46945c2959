"""Common library of the gpu-dra services: config, event catalog, NATS bus, telemetry, embedded NATS.

Importing it loads kubernetes-asyncio lazily for the whole process (`shared.kube.lazyload`): its
generated API and model classes only when something uses them.
"""

from shared.kube import lazyload as _lazyload

_lazyload.install()
