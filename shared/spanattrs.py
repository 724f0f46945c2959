"""Span attribute names the tracing setup and the services share (no dependency of their own)."""

# A span attribute marking periodic work (a scan, a resync) that is its own root: the tracing setup's
# PeriodicSampler samples such roots at GPU_DRA_OTEL_PERIODIC_RATIO (default 0.01), so thousands of nodes'
# no-op passes do not flood the backend; what such a pass changes is traced in spans of its own.
PERIODIC = "gpu_dra.periodic"
