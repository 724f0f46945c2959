"""Compatibility entry point: the users and permissions generator lives in shared/natsusers.py and
runs as `gpu-dra nats credentials`; this script keeps `python deploy/nats/nats_users.py` working.

    python deploy/nats/nats_users.py --nodes gpu-a,gpu-b --credentials-dir ./nats-credentials
"""

from __future__ import annotations

from shared.natsusers import *  # noqa: F403 - the module's public names, for scripts and tests
from shared.natsusers import main

if __name__ == "__main__":
    raise SystemExit(main())
