"""Which workers on this host accept hard-link handles.

A worker in shared-memory mode writes one small file under
``<root>/dask-shm-<uid>/peers/`` named after its address and holds an
exclusive ``flock`` on it while it is registered. Because the file lives on the
root itself, a peer found there shares our tmpfs (hard links work there) and
our uid (the directory is 0700). An entry nobody holds a lock on belongs to a
worker that is gone (killed with SIGKILL, say, in whatever PID namespace): it
is ignored and removed.

The entry's content (JSON) says what else the peer shares with us:
``roots``, the identity tokens of the roots it keeps files in (see
:mod:`dask_shm.shared.root_id`: a sender hands a handle only for a file in a
root whose token the receiver lists), and ``refused``, per sender the root
tokens whose handles from it could not be resolved (a token copied along
with a directory: that sender sends files of those roots as bytes from then on), and
``p2p``, whether it takes P2P shard batches as files (see
:mod:`dask_shm.shared.p2p`; a worker whose batch directory could not be made
does not). The pid and start time are informative only. Content that cannot be parsed means "no
roots": bytes, never a handle the peer may not resolve.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote

from dask_shm import liveness
from dask_shm.shared import paths
from dask_shm.shared.paths import ENTRY_FLAGS, peers_directory

#: How long a positive or negative answer is trusted before the file is re-read.
CACHE_SECONDS = 2.0

#: The sender of :meth:`PeerRegistry.refuse` that stands for every peer.
ANY = "*"


def _serializing_address(address: str) -> bool:
    return not address.startswith("inproc://")


@dataclass(frozen=True)
class PeerEntry:
    """What a live peer published: the root tokens it shares files through,
    per sender the root tokens whose handles it refuses, and whether it
    takes P2P shard batches as files."""

    roots: frozenset[str]
    refused: dict[str, frozenset[str]]
    p2p: bool = False

    @classmethod
    def parse(cls, content: bytes) -> PeerEntry:
        try:
            doc = json.loads(content)
            roots = frozenset(str(t) for t in doc.get("roots", ()))
            refused = {
                str(a): frozenset(str(t) for t in ts)
                for a, ts in dict(doc.get("refused", {})).items()
            }
            p2p = doc.get("p2p") is True
        except (ValueError, TypeError, AttributeError):
            return cls(frozenset(), {})
        return cls(roots, refused, p2p)


def _read_live_entry(path: str, remove_if_dead: bool) -> PeerEntry | None:
    """The content of registry entry ``path`` if someone holds its lock, else
    None; a dead entry is unlinked when ``remove_if_dead`` (unless it was
    replaced meanwhile)."""
    try:
        fd = os.open(path, ENTRY_FLAGS)
    except OSError:
        return None
    try:
        if not liveness.try_lock(fd, shared=True):
            return PeerEntry.parse(os.pread(fd, 1 << 16, 0))
        if remove_if_dead and liveness.still_named(path, fd):
            try:
                os.unlink(path)
            except OSError:
                pass
        return None
    finally:
        os.close(fd)


def _write(fd: int, content: bytes) -> None:
    os.write(fd, content)


class PeerRegistry:
    def __init__(self, root: str):
        self.directory = peers_directory(root)
        self._cache: dict[str, tuple[float, PeerEntry | None]] = {}
        #: address -> descriptor holding the lock of our entry
        self._held: dict[str, int] = {}
        #: address -> what we published for it
        self._published: dict[str, dict] = {}

    def _path(self, address: str) -> str:
        return os.path.join(self.directory, quote(address, safe=""))

    def register(self, address: str, roots: Iterable[str] = (), p2p: bool = False) -> None:
        """Announce that the worker at ``address`` (this process) accepts handles
        for files in the roots whose identity tokens are ``roots`` (and, with
        ``p2p``, P2P shard batch files in them), until :meth:`unregister` or
        this process's death. An ``inproc://`` address
        is never announced: its messages are not serialized, so it could not
        turn a handle back into a value."""
        if not _serializing_address(address):
            return
        self.unregister(address)
        me = paths.ProcessIdentity.current()
        doc: dict = {
            "pid": me.pid,
            "start": me.start,
            "roots": sorted(roots),
            "refused": {},
            "p2p": p2p,
        }
        tmp = f"{self._path(address)}.{uuid.uuid4().hex[:8]}.tmp"
        content = json.dumps(doc).encode()
        # Locked and written before it is visible under its name: never seen
        # dead, never seen empty.
        fd = liveness.publish_locked(
            tmp, self._path(address), directory=False, before_publish=lambda fd: _write(fd, content)
        )
        self._held[address] = fd
        self._published[address] = doc
        self._cache.pop(address, None)

    def refuse(self, address: str, sender: str, token: str) -> None:
        """Ask ``sender`` (:data:`ANY`: every peer) to send files of the root
        with identity ``token`` as bytes to our worker at ``address`` from now
        on (its handles there could not be resolved here). Peers see it within
        :data:`CACHE_SECONDS`."""
        fd = self._held.get(address)
        doc = self._published.get(address)
        if fd is None or doc is None or token in doc["refused"].get(sender, ()):
            return
        doc["refused"].setdefault(sender, []).append(token)
        content = json.dumps(doc).encode()
        # Rewritten in place (the lock belongs to this inode); a reader that
        # catches it half-written parses nothing, which means bytes: safe.
        os.pwrite(fd, content, 0)
        os.ftruncate(fd, len(content))

    def unregister(self, address: str) -> None:
        """Withdraw our entry for ``address`` (nothing if it is not ours)."""
        self._cache.pop(address, None)
        self._published.pop(address, None)
        fd = self._held.pop(address, None)
        if fd is None:
            return
        try:
            path = self._path(address)
            if os.lstat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except OSError:
            pass
        finally:
            os.close(fd)

    def accepts_handles(self, address: str | None) -> bool:
        """Whether ``address`` is a live worker on our tmpfs in shared-memory mode."""
        return self.entry(address) is not None

    def entry(self, address: str | None) -> PeerEntry | None:
        """What the live worker at ``address`` on our tmpfs published, or None
        (not registered here, gone, or an ``inproc://`` address)."""
        if not address or not _serializing_address(address):
            return None
        now = time.monotonic()
        cached = self._cache.get(address)
        if cached is not None and now - cached[0] < CACHE_SECONDS:
            return cached[1]
        answer = _read_live_entry(self._path(address), remove_if_dead=True)
        self._cache[address] = (now, answer)
        return answer

    def shared_roots(self, address: str | None, sender: str, ours: Iterable[str]) -> set[str]:
        """Which of the root tokens ``ours`` the worker at ``address`` shares
        and accepts handles in from ``sender``: empty when it is not a live
        peer on our tmpfs."""
        entry = self.entry(address)
        if entry is None:
            return set()
        refused = entry.refused.get(sender, frozenset()) | entry.refused.get(ANY, frozenset())
        return {t for t in ours if t in entry.roots and t not in refused}
