"""The `gpu-dra` console script: one subcommand per service and tool, dispatched lazily; `--version`; the
operator's errors (a bad file, a server out of reach) as one line (shared/clierrors.py)."""

from __future__ import annotations

import importlib
import sys

from shared import clierrors

COMMANDS: dict[str, tuple[str, str]] = {
    "discovery": ("services.discovery.cli", "NVML inventory, health and device operations for one node"),
    "publisher": ("services.publisher.cli", "inventory and health -> ResourceSlices"),
    "state-gate": ("services.stategate.cli", "node services' one door to JetStream: rights and shares checked"),
    "nodeconfig": ("shared.nodeconfig_cli", "'nodeconfig explain NODE': each GPU's sharing setting and its rule"),
    "preparer": ("services.preparer.cli", "the kubelet DRA plugin (prepare/unprepare, CDI, checkpoint)"),
    "cdi": ("services.preparer.nodespec", "'cdi generate': this node's CDI spec (driver userspace + GPUs)"),
    "computedomain": ("services.computedomain.cli", "ComputeDomain controller and node agent"),
    "dashboard": ("services.dashboard.main", "the live fleet page and its API (docs/dashboard.md)"),
    "apiserver": ("embedded.apiserver.cli", "the embedded Kubernetes API server"),
    "kubelet": ("embedded.nodeagent.cli", "the kubelet emulator for one simulated node"),
    "scheduler": ("embedded.scheduler.cli", "the DRA scheduler of the local cluster"),
    "controllers": ("embedded.controllers.cli", "Deployment, ReplicaSet and Job controllers of the local cluster"),
    "up": ("embedded.cluster.up", "a local GPU cluster: NATS, API server, simulated nodes"),
    "demo": ("embedded.cluster.demo", "run sample workloads on a local cluster and show the result"),
    "pipeline-demo": ("embedded.cluster.pipeline_demo", "inventory -> NATS -> ResourceSlices in one process, traced"),
    "explain": ("embedded.cluster.explain", "why a pod or claim is (not) allocated"),
    "trace": ("embedded.cluster.tracecli", "one claim's trace as a waterfall, from a span-store or OTLP-JSON file"),
    "features": ("shared.featuregates_cli", "the feature gates: stage, default, and what a setting turns on"),
    "webhook": ("services.webhook.cli", "the admission webhook: claims' opaque configs checked at the door"),
    "events": ("shared.events.cli", "the event catalog: list subjects, export JSON Schemas"),
    "nats": ("shared.natsserver_cli", "an embedded nats-server; 'nats credentials': NATS JWT creds as Secrets"),
}


# Commands of the local-cluster world: they need the `embedded` extra and the embedded/ package, which
# the production image leaves out.
EMBEDDED_EXTRA = "embedded"
_EMBEDDED_MODULES = ("embedded", "kubernetes_validate", "cel")


def usage() -> str:
    lines = ["usage: gpu-dra <command> [options]   (gpu-dra --version: the version)", "", "commands:"]
    lines += [f"  {name:<14} {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "Run 'gpu-dra <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] in ("--version", "version"):
        from shared.telemetry import package_version

        print(f"gpu-dra {package_version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"gpu-dra: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, _ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if module_name.startswith("embedded.") or missing in _EMBEDDED_MODULES:
            print(
                f"gpu-dra: command {name!r} is part of the local-cluster world, which this install lacks "
                f"(no module {exc.name!r}); install it with: pip install 'gpu-dra[{EMBEDDED_EXTRA}]' "
                "(a production image runs only the services)",
                file=sys.stderr,
            )
        else:
            print(f"gpu-dra: command {name!r} is not available in this build ({exc})", file=sys.stderr)
        return 2
    if not clierrors.long_running(args):
        # a one-shot command's retries (NATS dials, ...) are not news; its result or its one-line error are
        from shared.logs import setup_logging

        setup_logging(f"gpu-dra-{name}", "error")
    try:
        result = module.main(rest)
    except Exception as exc:  # noqa: BLE001 - the operator's errors become one line; the rest re-raised
        line = clierrors.one_line(exc)
        if line is None:
            raise
        print(f"gpu-dra {name}: {line}", file=sys.stderr)
        return clierrors.exit_status(exc, args)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
