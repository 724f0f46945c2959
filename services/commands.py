"""The `gpu-dra` commands of the services: what a production image runs. Registered in pyproject.toml's
`gpu_dra.commands` group (shared/cli.py); each entry is name -> (module with a `main(argv)`, one-line summary).
Nothing is imported here: `gpu-dra --help` reads this."""

COMMANDS: dict[str, tuple[str, str]] = {
    "discovery": ("services.discovery.cli", "NVML inventory, health and device operations for one node"),
    "publisher": ("services.publisher.cli", "inventory and health -> ResourceSlices"),
    "state-gate": ("services.stategate.cli", "node services' one door to JetStream: rights and shares checked"),
    "preparer": ("services.preparer.cli", "the kubelet DRA plugin (prepare/unprepare, CDI, checkpoint)"),
    "cdi": ("services.preparer.nodespec", "'cdi generate': this node's CDI spec (driver userspace + GPUs)"),
    "computedomain": ("services.computedomain.cli", "ComputeDomain controller and node agent"),
    "dashboard": ("services.dashboard.main", "the live fleet page and its API (docs/dashboard.md)"),
    "webhook": ("services.webhook.cli", "the admission webhook: claims' opaque configs checked at the door"),
}
