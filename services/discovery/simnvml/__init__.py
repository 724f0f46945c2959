"""The simulated NVML binding: same calls, structs and error codes as pynvml, backed by a JSON state."""

from services.discovery.simnvml.binding import SimNvml, gpu_uuid

__all__ = ["SimNvml", "gpu_uuid"]
