"""The local cluster: an embedded API server, a DRA scheduler, controllers, a kubelet emulator, `gpu-dra up`, and
the test harness around them (the `embedded` extra brings its requirements).

The boundary: the product (shared/, services/) never imports this package, so a production image ships without
it; this package uses the product as any client would. `gpu-dra` finds the commands here through their
registration (embedded/commands.py, pyproject.toml's `gpu_dra.commands` group), not through a list in the
product; tests/deploy/test_container_and_settings.py holds the product to that."""
