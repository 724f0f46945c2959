"""The `gpu-dra` commands that shared/ itself provides: operator tools over the settings, the feature gates, the
event catalog and NATS. Registered in pyproject.toml's `gpu_dra.commands` group (shared/cli.py); each entry is
name -> (module with a `main(argv)`, one-line summary). Nothing is imported here: `gpu-dra --help` reads this."""

COMMANDS: dict[str, tuple[str, str]] = {
    "nodeconfig": ("shared.nodeconfig_cli", "'nodeconfig explain NODE': each GPU's sharing setting and its rule"),
    "features": ("shared.featuregates_cli", "the feature gates: stage, default, and what a setting turns on"),
    "events": ("shared.events.cli", "the event catalog: list subjects, export JSON Schemas"),
    "nats": ("shared.natsserver_cli", "an embedded nats-server; 'nats credentials': NATS JWT creds as Secrets"),
}
