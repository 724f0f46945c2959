"""kubernetes-asyncio without its ~1,500 generated API and model classes until something uses them.

`import kubernetes_asyncio.client` executes the package's `__init__`, which imports every API class
and every model: ~39 MB of RSS and ~0.5 s of CPU per process, for the preparer a third of its
memory, though it only needs `Configuration`, `ApiClient` and the REST layer (its requests are raw
JSON decoded with msgspec). `install()` puts light stand-ins for the package and its `client`,
`client.models` and `config` packages into `sys.modules` before kubernetes-asyncio is first imported:

- a submodule (`client.api_client`, `client.rest`, `client.exceptions`, `client.api.core_v1_api`...)
  is imported as usual, on its own;
- `ApiClient`, `Configuration` and the exception classes come from their own submodules, and so do
  `config.load_incluster_config` and `config.load_kube_config` (in a pod, the kubeconfig loader and
  PyYAML are never imported);
- any other attribute (`client.CoreV1Api`, `client.V1Pod`, `client.models.V1Status`) runs the
  package's real `__init__` into the stand-in once, after which it is the whole package.

While one of the light client's submodules is imported, the third-party modules it imports at its top
but uses only on paths the services do not take are deferred too (`_DEFERRED`): urllib3 (the basic-auth
header), dateutil's parser (dates into models) and multiprocessing's ThreadPool (`async_req`), ~1.6 MB
of RSS together. The module gets a stand-in whose names load the real module when first used; the
stand-in leaves `sys.modules` when that import is done, so any other importer gets the real module.

So code written against the normal package works unchanged (the first typed API use pays what an
eager import would have); a process that only makes raw requests never loads the models. It is
installed by `shared/__init__.py`, before anything of ours imports kubernetes-asyncio; when the
package was imported already, nothing changes.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

PACKAGE = "kubernetes_asyncio"

# names the light client serves from their own submodules, without the package __init__
_CLIENT_NAMES = {
    "ApiClient": "api_client",
    "Configuration": "configuration",
    "ApiException": "exceptions",
    "ApiValueError": "exceptions",
    "ApiTypeError": "exceptions",
    "ApiKeyError": "exceptions",
    "OpenApiException": "exceptions",
}


# names the light `config` package serves from their own submodules: in a pod, loading the in-cluster
# credentials never imports the kubeconfig loader (PyYAML, exec/OIDC/GCP auth)
_CONFIG_NAMES = {
    "ConfigException": "config_exception",
    "load_incluster_config": "incluster_config",
    **dict.fromkeys(("load_kube_config", "load_kube_config_from_dict", "list_kube_config_contexts",
                     "new_client_from_config", "new_client_from_config_dict", "refresh_token",
                     "KUBE_CONFIG_DEFAULT_LOCATION"), "kube_config"),
}

# module -> the names the client's modules take from it with `from module import name` (each is called,
# never tested with isinstance); a bare `import module` needs none
_DEFERRED: dict[str, tuple[str, ...]] = {
    "urllib3": (),  # configuration: urllib3.util.make_headers, for basic auth only
    "dateutil.parser": ("parse",),  # api_client: dates and date-times into models
    "multiprocessing.pool": ("ThreadPool",),  # api_client: the pool behind async_req=True
}


def _real(name: str, stand_in: types.ModuleType) -> types.ModuleType:
    if sys.modules.get(name) is stand_in:  # used while its import is still under way: import it for real now
        del sys.modules[name]
    return importlib.import_module(name)


class _Deferred(types.ModuleType):
    """Stands in for module `name` inside one import: `names` forward each call, any other attribute
    is read from the real module (imported on that first use)."""

    def __init__(self, name: str, names: tuple[str, ...]) -> None:
        super().__init__(name)
        for attr in names:
            self.__dict__[attr] = self._forwarder(attr)

    def _forwarder(self, attr: str) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return getattr(_real(self.__name__, self), attr)(*args, **kwargs)

        forward.__name__ = forward.__qualname__ = attr
        return forward

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(_real(self.__name__, self), attr)


@contextlib.contextmanager
def _deferring() -> Iterator[None]:
    """Stand-ins for the `_DEFERRED` modules not imported yet, for the length of the block."""
    placed = [name for name in _DEFERRED if name not in sys.modules]
    for name in placed:
        sys.modules[name] = _Deferred(name, _DEFERRED[name])
    try:
        yield
    finally:
        for name in placed:
            if isinstance(sys.modules.get(name), _Deferred):
                del sys.modules[name]


class _LazyPackage(types.ModuleType):
    """A package whose `__init__` runs only when an attribute it defines is first asked for."""

    def __init__(self, name: str, path: str, names: dict[str, str]) -> None:
        super().__init__(name)
        self.__path__ = [path]
        self.__package__ = name
        self.__file__ = os.path.join(path, "__init__.py")
        self.__spec__ = importlib.util.spec_from_file_location(name, self.__file__, submodule_search_locations=[path])
        self.__loader__ = self.__spec__.loader if self.__spec__ is not None else None
        self.__dict__["_lazy_names"] = names
        self.__dict__["_lazy_loaded"] = False

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr not in ("__all__", "__version__"):
            raise AttributeError(attr)
        value = self._resolve(attr)
        self.__dict__[attr] = value  # asked once: later lookups are plain attribute reads
        return value

    def _resolve(self, attr: str) -> Any:
        base = self.__path__[0]
        if os.path.exists(os.path.join(base, f"{attr}.py")) or os.path.exists(os.path.join(base, attr, "__init__.py")):
            with _deferring():
                return importlib.import_module(f"{self.__name__}.{attr}")
        sub = self.__dict__["_lazy_names"].get(attr)
        if sub is not None:
            with _deferring():
                return getattr(importlib.import_module(f"{self.__name__}.{sub}"), attr)
        if not self.__dict__["_lazy_loaded"]:
            self.__dict__["_lazy_loaded"] = True
            assert self.__file__ is not None
            with open(self.__file__, encoding="utf-8") as source:
                code = compile(source.read(), self.__file__, "exec")
            exec(code, self.__dict__)  # noqa: S102 - the installed package's own __init__, run into its stand-in
            if attr in self.__dict__:
                return self.__dict__[attr]
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")


def install() -> bool:
    """Install the light `client`, `client.models` and `config`; False when kubernetes-asyncio was imported
    already or is not installed (then nothing changes)."""
    if PACKAGE in sys.modules or f"{PACKAGE}.client" in sys.modules:
        return False
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return False
    root = next(iter(spec.submodule_search_locations))
    package = _LazyPackage(PACKAGE, root, {})
    client = _LazyPackage(f"{PACKAGE}.client", os.path.join(root, "client"), _CLIENT_NAMES)
    models = _LazyPackage(f"{PACKAGE}.client.models", os.path.join(root, "client", "models"), {})
    config = _LazyPackage(f"{PACKAGE}.config", os.path.join(root, "config"), _CONFIG_NAMES)
    sys.modules[PACKAGE] = package
    for light in (client, models, config):
        sys.modules[light.__name__] = light
    client.__dict__["models"] = models
    package.__dict__["client"] = client
    package.__dict__["config"] = config
    return True
