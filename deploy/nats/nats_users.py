"""Compatibility entry point for `gpu-dra nats credentials` (shared/natscreds.py): the deployment's
NATS users, their permissions (shared/natsusers.py) and JWT/NKEY credentials as Kubernetes Secrets.

    python deploy/nats/nats_users.py --nodes gpu-a,gpu-b --credentials-dir ./nats-keys --output ./out
"""

from __future__ import annotations

from shared.natscreds import main
from shared.natsusers import *  # noqa: F403 - the permission functions, for scripts and tests

if __name__ == "__main__":
    raise SystemExit(main())
