#!/usr/bin/env bash
# The packages the lent GPU machines lack (Ray, Prefect, DuckDB, datasets, s3fs, math_verify, pydantic and their
# needs, minus what the image has: bench/gpu_site.txt), installed here for CPython
# 3.12 and tarred with xz into two parts of <= 44 MB, one carried per call (the 157 MB of wheels took three).
#   bash bench/gpu_site.sh build                  # here: writes .parts/gsite.part.* (git-ignored; ~6 min)
#   bash bench/gpu_site.sh unpack PART_A PART_B   # there: /tmp/gsite, then
#   export PYTHONPATH=/tmp/gsite:$PWD PATH=/tmp/gsite/bin:$PATH
# Ray's Java jars and rllib are left out (not used), and every package's tests.
set -euo pipefail
case $1 in
build)
    rm -rf /tmp/gpuwhl /tmp/gsite && mkdir -p /tmp/gpuwhl .parts
    platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64
               --platform manylinux2014_x86_64 --platform any"
    .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 $platforms -d /tmp/gpuwhl \
        -r bench/gpu_site.txt
    .venv/bin/pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 $platforms \
        --target /tmp/gsite /tmp/gpuwhl/*.whl
    rm -rf /tmp/gsite/ray/jars /tmp/gsite/ray/rllib
    find /tmp/gsite -type d \( -name tests -o -name test \) -prune -exec rm -rf {} +
    tar cf - -C /tmp gsite | xz -9e -T2 > /tmp/gsite.tar.xz
    rm -f .parts/gsite.part.* && split -b 44000000 /tmp/gsite.tar.xz .parts/gsite.part.
    ls -l .parts ;;
unpack)
    cat "$2" "$3" | xz -d | tar xf - -C /tmp
    # pip wrote this machine's venv into the scripts' first lines
    sed -i '1s|^#!.*python.*$|#!/usr/bin/env python3|' /tmp/gsite/bin/* ;;
esac
