"""Device utilisation as discovery samples it from NVML: one batched message per node per interval.

Not durable state: a sample is stale within one interval and the next one replaces it, so it travels on core
NATS (no stream stores it, nothing replays it); a consumer that was away keeps a gap in its graph, not a
wrong figure.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.events.base import OBSERVED_AT, Message, doc


class DeviceSample(msgspec.Struct, kw_only=True):
    """One device's figures at the sample time; a figure NVML does not give for it is null."""

    device: Annotated[str, doc("The device name, gpu-<minor> or a MIG device name, as in the inventory.")]
    uuid: Annotated[str, doc("The GPU or MIG device UUID.")] = ""
    sm_percent: Annotated[
        int | None,
        doc(
            "Percent of the sample period in which a kernel ran on the GPU (nvmlDeviceGetUtilizationRates.gpu); "
            "null where NVML gives none (MIG devices, GPUs in MIG mode).",
            unit="percent",
        ),
    ] = None
    memory_used_bytes: Annotated[
        int | None, doc("Framebuffer memory in use (nvmlDeviceGetMemoryInfo.used).", unit="bytes")
    ] = None
    memory_total_bytes: Annotated[
        int | None, doc("Framebuffer memory of the device (nvmlDeviceGetMemoryInfo.total).", unit="bytes")
    ] = None
    power_mw: Annotated[int | None, doc("Power draw (nvmlDeviceGetPowerUsage); null on MIG devices.", unit="mW")] = None
    temperature_c: Annotated[
        int | None,
        doc("GPU die temperature (nvmlDeviceGetTemperature, NVML_TEMPERATURE_GPU); null on MIG devices.", unit="Cel"),
    ] = None


class NodeTelemetry(Message, kw_only=True):
    """Every device of a node, sampled at once. Subject `dra.v1.telemetry.<node>`; core NATS, not stored."""

    node: Annotated[str, doc("The node; equals the subject's node token.")]
    interval_s: Annotated[float, doc("The node's sampling interval: the next message is due this long after.")] = 0.0
    devices: Annotated[list[DeviceSample], doc("The node's GPUs and MIG devices.")] = msgspec.field(
        default_factory=list
    )
    observed_at: Annotated[float, OBSERVED_AT] = 0.0
