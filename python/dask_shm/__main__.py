from dask_shm.cli import main

main()
