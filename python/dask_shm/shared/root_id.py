"""Which file systems two workers really share: one identity token per root.

Two workers may share a tmpfs (containers bind-mounting one ``/dev/shm``)
and still have different tier-3 directories under the same path (each
container's own ``/tmp``), or share nothing at all. A path says nothing about
that; a file does. Each root holds ``<root>/dask-shm-<uid>/root-id``, a
random token created once, atomically (the first process to link its
candidate in wins, everyone reads the winner's). Two workers that read the
same token for a root see the same directory there, so a hard link one makes
in it the other can open. Workers publish their tokens in the peer registry
(:mod:`dask_shm.shared.registry`); a sender hands a handle only for a file in
a root whose token the receiver published, and sends everything else as bytes.
A token that does not match never links anything, so a stale or missing one
costs speed, not correctness.
"""

from __future__ import annotations

import os
import uuid

from dask_shm.shared import paths

TOKEN_FILE = "root-id"

#: realpath of a root -> (inode of its user directory, token)
_cache: dict[str, tuple[int, str]] = {}


def _read(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        token = os.read(fd, 64).decode("ascii", errors="replace").strip()
    finally:
        os.close(fd)
    return token or None


def root_token(root: str) -> str:
    """The identity token of ``root`` (made on first use). Raises OSError
    when the user directory or the token file cannot be made or read."""
    user_dir = paths.user_root(root)
    inode = os.stat(user_dir).st_ino
    real = os.path.realpath(root)
    cached = _cache.get(real)
    if cached is not None and cached[0] == inode:
        return cached[1]
    path = os.path.join(user_dir, TOKEN_FILE)
    token = _read(path)
    if token is None:
        candidate = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(
            candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400
        )
        try:
            os.write(fd, uuid.uuid4().hex.encode())
        finally:
            os.close(fd)
        try:
            os.link(candidate, path)  # never replaces: the first token stays
        except FileExistsError:
            pass
        finally:
            os.unlink(candidate)
        token = _read(path)
        if token is None:
            raise OSError(f"the identity token {path} vanished while being made")
    _cache[real] = (inode, token)
    return token
