"""Services run in-process for tests, benches and the pipeline demo (never shipped in the image)."""
