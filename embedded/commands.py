"""The `gpu-dra` commands of the local cluster (`gpu-dra up` and its parts). Registered in pyproject.toml's
`gpu_dra.commands` group under the name of the `embedded` extra, which a production image leaves out together
with this package (shared/cli.py then names the extra); each entry is name -> (module with a `main(argv)`,
one-line summary). Nothing is imported here: `gpu-dra --help` reads this."""

COMMANDS: dict[str, tuple[str, str]] = {
    "apiserver": ("embedded.apiserver.cli", "the embedded Kubernetes API server"),
    "kubelet": ("embedded.nodeagent.cli", "the kubelet emulator for one simulated node"),
    "scheduler": ("embedded.scheduler.cli", "the DRA scheduler of the local cluster"),
    "controllers": ("embedded.controllers.cli", "Deployment, ReplicaSet and Job controllers of the local cluster"),
    "up": ("embedded.cluster.up", "a local GPU cluster: NATS, API server, simulated nodes"),
    "demo": ("embedded.cluster.demo", "run sample workloads on a local cluster and show the result"),
    "pipeline-demo": ("embedded.cluster.pipeline_demo", "inventory -> NATS -> ResourceSlices in one process, traced"),
    "explain": ("embedded.cluster.explain", "why a pod or claim is (not) allocated"),
    "trace": ("embedded.cluster.tracecli", "one claim's trace as a waterfall, from a span-store or OTLP-JSON file"),
}
