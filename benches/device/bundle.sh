#!/usr/bin/env bash
# Build .devbundle/whl on the dev box: what the lent 16-core machine lacks to
# run our benches (see ../shared/device-bench.md). That machine has no
# network and its python3 (3.12) has numpy, pandas, pyarrow, psutil, pytest,
# pytest-benchmark, pyyaml, msgpack, cloudpickle, toolz and fsspec, but not
# dask, distributed, zict, tornado, tblib, partd, locket, our config schema's
# validator (fastjsonschema), pytest-timeout, flox and
# numpy_groupies (the xarray workloads; xarray is carried too, so that its
# version is one with xarray.groupers.TimeResampler) or our wheel.
#
# usage: benches/device/bundle.sh [PYTHON_VERSION]   (default 3.12, the device's)
# Then pass `carry: [".devbundle"]` to every device run and start it with
# benches/device/run.sh (the checkout's benches/ and tests/ travel with it).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYVER="${1:-3.12}"
grep -qxF /.devbundle/ .git/info/exclude 2>/dev/null || echo /.devbundle/ >> .git/info/exclude
rm -rf .devbundle/whl
mkdir -p .devbundle/whl
# The versions CI tests (pyproject.toml's upper bounds).
PACKAGES=(
    dask==2026.8.0 distributed==2026.8.0 zict==3.0.0 tornado tblib partd locket
    fastjsonschema typing_extensions
    pytest-timeout importlib_metadata zipp lazy-importer
    xarray flox numpy_groupies
)
python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    -d .devbundle/whl "${PACKAGES[@]}"
maturin build --release --locked -o .devbundle/whl   # abi3: loads on 3.11+
# The commit the wheel was built from (the device's copy has no .git).
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- rust python Cargo.toml pyproject.toml || echo '+uncommitted changes')" > .devbundle/commit
du -sh .devbundle
ls .devbundle/whl
