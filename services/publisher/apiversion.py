"""What the API server speaks: the `resource.k8s.io` version to write and the limits its version implies.

Owns discovery (`GET /apis/resource.k8s.io`, `GET /version`) and the version-dependent rules:
1.35+ servers want counter sets in a slice of their own and allow only 64 devices in a slice that
has taints or counter consumption; 1.34 keeps counters beside the devices that consume them.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from shared.kube.versions import best_version

SUPPORTED_VERSIONS = ("v1", "v1beta1")
Layout = Literal["beside-devices", "counters-only-slice"]

_MINOR = re.compile(r"^(\d+)", re.ASCII)


class ApiDiscoveryError(RuntimeError):
    """The server does not serve a resource.k8s.io version we can write."""


class ServerProfile(msgspec.Struct, frozen=True, kw_only=True):
    """The API server as the publisher sees it."""

    api_version: str = "v1"  # resource.k8s.io version written
    major: int = 1
    minor: int = 34
    git_version: str = ""
    counter_layout: Layout = "beside-devices"

    @property
    def group_version(self) -> str:
        return f"resource.k8s.io/{self.api_version}"

    def max_devices(self, tainted_or_counters: bool) -> int:
        """Devices allowed in one slice (1.35+: 64 when any device has taints or consumesCounters)."""
        if tainted_or_counters and (self.major, self.minor) >= (1, 35):
            return 64
        return 128

    @property
    def max_counter_sets_per_slice(self) -> int:
        return 8

    @property
    def max_counters_per_slice(self) -> int:
        """1.34: counters summed over all sets in a slice; 1.35+: per set (sets per slice capped at 8)."""
        return 32

    @property
    def consumable_capacity(self) -> bool:
        """Whether devices may set `allowMultipleAllocations` and capacity `requestPolicy` (v1, 1.34+)."""
        return self.api_version == "v1" and (self.major, self.minor) >= (1, 34)

    @property
    def taint_effect_none(self) -> bool:
        """Whether the informational `None` taint effect exists (1.35+)."""
        return (self.major, self.minor) >= (1, 35)


def layout_for(major: int, minor: int) -> Layout:
    return "counters-only-slice" if (major, minor) >= (1, 35) else "beside-devices"


def parse_minor(text: str) -> int:
    """`"35"`, `"35+"` (GKE style) -> 35; ApiDiscoveryError for anything else."""
    m = _MINOR.match(text or "")
    if m is None:
        raise ApiDiscoveryError(f"server reported minor version {text!r}, which is not a number")
    return int(m.group(1))


def choose_version(served: list[str], wanted: str = "auto") -> str:
    """The version to write: v1 over v1beta1 on `auto`; a forced one must be served."""
    if wanted != "auto":
        if wanted not in served:
            raise ApiDiscoveryError(
                f"--api-version {wanted} asked for, but the server serves resource.k8s.io {served or 'not at all'}"
            )
        return wanted
    version = best_version(served, SUPPORTED_VERSIONS)
    if version is not None:
        return version
    raise ApiDiscoveryError(
        f"the API server serves resource.k8s.io {served or 'not at all'}; the publisher needs v1 (1.34+) "
        "or v1beta1 (1.32/1.33 with DynamicResourceAllocation enabled)"
    )


def profile_from(
    group: dict[str, object], version: dict[str, object], *, wanted: str = "auto", layout: str = "auto"
) -> ServerProfile:
    """A ServerProfile from the decoded APIGroup and version.Info documents."""
    versions = group.get("versions")
    served = [str(v.get("version")) for v in (versions if isinstance(versions, list) else []) if isinstance(v, dict)]
    api_version = choose_version(served, wanted)
    try:
        major = int(str(version.get("major") or "1"))
    except ValueError:
        major = 1
    minor = parse_minor(str(version.get("minor") or ""))
    chosen: Layout = layout_for(major, minor) if layout == "auto" else layout  # type: ignore[assignment]
    return ServerProfile(
        api_version=api_version,
        major=major,
        minor=minor,
        git_version=str(version.get("gitVersion") or ""),
        counter_layout=chosen,
    )


async def discover(api_client: object, *, wanted: str = "auto", layout: str = "auto") -> ServerProfile:
    """Ask the server (a kubernetes-asyncio ApiClient) which version to write and how to lay out counters."""
    from shared.kube.rest import get_json

    try:
        group = await get_json(api_client, "/apis/resource.k8s.io")
    except Exception as exc:
        raise ApiDiscoveryError(
            f"cannot read /apis/resource.k8s.io ({exc}); is DynamicResourceAllocation enabled on the server?"
        ) from exc
    version = await get_json(api_client, "/version")
    return profile_from(group, version, wanted=wanted, layout=layout)
