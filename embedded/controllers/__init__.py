"""Workload controllers for the local cluster: Deployment -> ReplicaSet -> Pods, Job -> Pods."""
