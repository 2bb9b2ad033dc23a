"""Which workers on this host accept hard-link handles.

A worker in shared-memory mode writes one small file under
``<root>/dask-shm-<uid>/peers/`` named after its address, holding its process
identity. Because the file lives on the root itself, a peer found there shares
our file system (hard links work) and our uid (the directory is 0700). An
entry whose process is gone (killed with SIGKILL, say) is ignored and removed.
"""

from __future__ import annotations

import json
import os
import time
from urllib.parse import quote

from dask_shm.shared import paths

#: How long a positive or negative answer is trusted before the file is re-read.
CACHE_SECONDS = 2.0


def _serializing_address(address: str) -> bool:
    return not address.startswith("inproc://")


class PeerRegistry:
    def __init__(self, root: str):
        self.directory = os.path.join(paths.user_root(root), "peers")
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._cache: dict[str, tuple[float, bool]] = {}

    def _path(self, address: str) -> str:
        return os.path.join(self.directory, quote(address, safe=""))

    def register(self, address: str) -> None:
        """Announce that the worker at ``address`` (this process) accepts handles.
        An ``inproc://`` address is never announced: its messages are not
        serialized, so it could not turn a handle back into a value."""
        if not _serializing_address(address):
            return
        me = paths.ProcessIdentity.current()
        tmp = f"{self._path(address)}.{me.pid}.tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": me.pid, "start": me.start}, f)
        os.replace(tmp, self._path(address))

    def unregister(self, address: str) -> None:
        try:
            with open(self._path(address)) as f:
                owner = json.load(f)
            if owner.get("pid") == os.getpid():
                os.unlink(self._path(address))
        except (OSError, ValueError):
            pass
        self._cache.pop(address, None)

    def accepts_handles(self, address: str | None) -> bool:
        """Whether ``address`` is a live worker of this host in shared-memory mode."""
        if not address or not _serializing_address(address):
            return False
        now = time.monotonic()
        cached = self._cache.get(address)
        if cached is not None and now - cached[0] < CACHE_SECONDS:
            return cached[1]
        answer = self._check(address)
        self._cache[address] = (now, answer)
        return answer

    def _check(self, address: str) -> bool:
        try:
            with open(self._path(address)) as f:
                owner = json.load(f)
            ident = paths.ProcessIdentity(int(owner["pid"]), int(owner["start"]))
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if ident.alive():
            return True
        try:
            os.unlink(self._path(address))
        except OSError:
            pass
        return False
