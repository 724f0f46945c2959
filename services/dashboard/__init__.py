"""Fleet dashboard (issue 20): read-only view of nodes, GPUs, MIG slices and claims."""
