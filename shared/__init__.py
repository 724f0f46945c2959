"""Common library of the gpu-dra services: config, event catalog, NATS bus, telemetry, embedded NATS."""
