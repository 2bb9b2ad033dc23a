"""Start a LocalCluster under whatever ``shm.*`` config the environment gives.

Run as a script (``python bad_config_cluster.py '<json options>'``) by
``test_bad_config_startup.py``, in a process of its own so that a cluster that
hangs fails the test by a timeout instead of hanging the test run. Options:
``processes`` (LocalCluster's), ``register`` (null, or "worker" / "nanny":
register that shared-memory plugin once the cluster started). Prints one JSON line: ``started`` and
``registered`` (booleans) and ``errors``, the exception raised with its
``__cause__`` chain as "<type>: <message>" strings.
"""

from __future__ import annotations

import json
import sys


def chain(error: BaseException | None) -> list[str]:
    out = []
    while error is not None:
        out.append(f"{type(error).__name__}: {error}")
        error = error.__cause__
    return out


def main(options: dict) -> dict:
    from distributed import Client, LocalCluster

    from dask_shm import SharedMemoryNannyPlugin, SharedMemoryPlugin

    result: dict = {"started": False, "registered": False, "errors": []}
    try:
        with (
            LocalCluster(
                n_workers=1,
                threads_per_worker=1,
                processes=options["processes"],
                memory_limit="512 MiB",
                dashboard_address=":0",
            ) as cluster,
            Client(cluster) as client,
        ):
            result["started"] = True
            if options.get("register"):
                plugin = {"worker": SharedMemoryPlugin, "nanny": SharedMemoryNannyPlugin}
                client.register_plugin(plugin[options["register"]]())
                result["registered"] = True
    except Exception as e:
        result["errors"] = chain(e)
    return result


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
