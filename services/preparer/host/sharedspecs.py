"""The CDI specs shares use together (`cdi` module doc): which claims use each, its write by the first of
them and its removal after the last.

A claim becomes a user before any await of its prepare (its record's `cdi_spec` names the spec, and this
module counts it), so a removal, which decides and unlinks in one step with no await, never takes a spec
from a claim that is about to complete with it. A spec is written once per process: the first user after a
start writes it again (the same bytes under the same name), so nothing need be known of the files a
crash left. Who uses what is read from the checkpoint the first time it is needed and kept since: a
record's `cdi_spec` is set here, and only here, for a shared spec. A crash between a spec's write and its
claim's `PrepareCompleted` leaves a spec no record names: the start's sweep removes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from services.preparer.host.cdi import CdiDevice, CdiWriter, ContainerEdits, build_spec, common_digest, spec_digest
from services.preparer.host.checkpoint import ClaimRecord
from shared.keyedlocks import KeyedLocks


class SharedSpecs:
    """The shared specs of one CDI writer, and their users among one checkpoint's claims."""

    def __init__(self, cdi: CdiWriter, claims: Callable[[], Mapping[str, ClaimRecord]]) -> None:
        self.cdi = cdi
        self._claims = claims
        self._users: dict[str, set[str]] | None = None  # digest -> claim uids; read from the checkpoint once
        self._written: set[str] = set()  # digests this process wrote (and has not removed since)
        self._writes: KeyedLocks[str] = KeyedLocks()  # one write of a spec at a time (they share a temp file)
        self._common: tuple[ContainerEdits | None, bytes] = (None, b"")  # the last spec-level edits, their digest

    def _users_of(self) -> dict[str, set[str]]:
        if self._users is None:
            self._users = {}
            for uid, record in self._claims().items():
                if digest := self.cdi.shared_digest(record.cdi_spec):
                    self._users.setdefault(digest, set()).add(uid)
        return self._users

    async def use(self, uid: str, record: ClaimRecord, devices: list[CdiDevice], common: ContainerEdits) -> str:
        """Make the claim a user of the spec of these edits, written if this process has not yet; its digest."""
        if self._common[0] is not common:  # the driver's common edits: one object while they are unchanged
            self._common = (common, common_digest(common))
        digest = spec_digest(devices, self._common[1], self.cdi.share_kind)
        record.cdi_spec = self.cdi.shared_file_name(digest)
        self._users_of().setdefault(digest, set()).add(uid)  # before the write's await (module doc)
        if digest not in self._written:
            async with self._writes.hold(digest):
                if digest not in self._written:
                    await self.cdi.write_shared(digest, build_spec(digest, devices, common, self.cdi.share_kind))
                    self._written.add(digest)
        return digest

    def release(self, uid: str, file_name: str) -> bool:
        """The claim no longer uses the shared spec `file_name`: removed if it was the last user (no await between
        the decision and the unlink). False when `file_name` is no shared spec."""
        digest = self.cdi.shared_digest(file_name)
        if not digest:
            return False
        users = self._users_of()
        holders = users.get(digest)
        if holders is not None:
            holders.discard(uid)
            if holders:
                return True
            del users[digest]
        self._written.discard(digest)
        self.cdi.remove_shared(digest)
        return True

    def in_use(self) -> set[str]:
        """The digests of the specs some claim uses (the sweep keeps them)."""
        return set(self._users_of())
