"""Memory that pyarrow's allocator holds after a value left memory, handed
back to the operating system.

pyarrow allocates from its own pool (mimalloc or jemalloc), which keeps freed
memory for reuse instead of returning it: after a worker wrote a value to a
shared file and dropped its private copy (an export to a peer, a spill), the
copy's pages, and those of the temporary buffers serialization made, stay
resident anonymous memory of the worker for as long as the pool likes. Host
memory then holds the value twice, once in the file and once in the pool.
"""

from __future__ import annotations

import sys

__all__ = ["release_unused"]


def release_unused() -> None:
    """Return the free memory of pyarrow's default pool to the operating
    system; nothing when pyarrow was never imported (this never imports it).
    About a microsecond when the pool has nothing to give back. Never raises."""
    pa = sys.modules.get("pyarrow")
    if pa is None:
        return
    try:
        pa.default_memory_pool().release_unused()
    except Exception:  # an old or partial pyarrow: nothing to gain, nothing to lose
        pass
