"""Embedded Kubernetes API server: HTTP/JSON API, storage, watch, validation, conversion and OpenAPI."""
