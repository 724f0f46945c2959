"""Who each process of the local cluster is to its nats-server, and what it may do there.

Owns `gpu-dra up`'s NATS credentials: the deployment's users and permissions (shared.natsusers:
`publisher`, `controller`, `admin`, and per node `discovery.<node>`, `preparer.<node>`,
`cd-agent.<node>`) issued as decentralized JWT/NKEY credentials, as `gpu-dra nats credentials` issues
them (shared.natscreds). Under `<data-dir>/identities/`: the seeds in `nats-keys/` (kept between runs:
nats-server keeps JetStream data per account, so the account key must stay for a second `up` to find
its streams), the server's operator/account block `nats-server.conf`, and one `nats/<user>.creds` per
identity, every file 0600. A process is made an identity by its environment (GPU_DRA_NATS_CREDS,
GPU_DRA_NATS_USER), never by an argument a `ps` would show.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from embedded.cluster.identities import write_secret
from shared.bus import NatsTLS
from shared.natscreds import issue
from shared.natsusers import all_users, node_user

ADMIN = "admin"  # `gpu-dra up` itself: provisions the streams and buckets, reads KV to judge readiness
PUBLISHER = "publisher"
CONTROLLER = "controller"  # the ComputeDomain controller


@dataclass(frozen=True)
class NatsIdentities:
    """The server's config file and each user's .creds file."""

    server_config: Path
    creds: dict[str, Path]

    def env(self, user: str) -> dict[str, str]:
        """The environment that makes a service `user` (its .creds file; the name must match it)."""
        return {"GPU_DRA_NATS_CREDS": str(self.creds[user]), "GPU_DRA_NATS_USER": user}

    def node_env(self, role: str, node: str) -> dict[str, str]:
        return self.env(node_user(role, node))

    def tls(self, user: str) -> NatsTLS:
        """What `Bus.connect(tls=...)` needs to connect as `user`."""
        return NatsTLS(creds_file=str(self.creds[user]))


def _issue(directory: Path, nodes: list[str], readers: Mapping[str, list[str]] | None) -> NatsIdentities:
    issued = issue(all_users(nodes, readers), directory / "nats-keys")
    header = (
        "# Written by `gpu-dra up` at every start: the operator, the GPU_DRA account (JetStream) and\n"
        "# the system account; each service's user JWT is in identities/nats/<user>.creds.\n"
    )
    config = write_secret(directory / "nats-server.conf", header + issued.server_config)
    creds = {user: write_secret(directory / "nats" / f"{user}.creds", text) for user, text in issued.creds.items()}
    return NatsIdentities(server_config=config, creds=creds)


async def issue_identities(
    directory: Path, nodes: list[str], readers: Mapping[str, list[str]] | None = None
) -> NatsIdentities:
    """Keys (kept or made), the server's config and every identity's .creds for `nodes` and third-party
    `readers` ({name: namespaces}, `reader.<name>`), off the loop."""
    return await asyncio.to_thread(_issue, directory, nodes, readers)
