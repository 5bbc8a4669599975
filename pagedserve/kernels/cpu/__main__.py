"""python -m pagedserve.kernels.cpu DIR: build the C++ kernels into DIR (ahead of time, as
the Docker image does; PAGEDSERVE_CPU_KERNELS_LIB then names the library)."""

import sys
from pathlib import Path

from pagedserve.kernels.cpu import build

if len(sys.argv) != 2:
    sys.exit("usage: python -m pagedserve.kernels.cpu BUILD_DIR")
Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
print(build(sys.argv[1]).__file__)
