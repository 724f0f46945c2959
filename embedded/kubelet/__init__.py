"""The kubelet emulator: the kubelet's side of plugin registration and the DRA gRPC protocols."""
