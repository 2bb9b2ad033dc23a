import sys

from dask_shm.cli import main

sys.exit(main())
