"""pagedserve: a paged-attention LLM serving backend."""

import os

# Idle OpenMP threads spin for ~1.6 ms (30,000 pauses on a Zen 4 EPYC), then sleep. A decode
# step runs ~300 parallel regions back to back, and waking a sleeping thread for each cost
# ~90 us on a 2-vCPU VM (docs/performance.md §5); spinning longer only burns CPU between
# steps. Where other busy processes share the cores, or under a container CPU quota, set
# OMP_WAIT_POLICY=PASSIVE (the Docker images do). Only takes effect if set before torch
# starts its thread pool, hence here, at package import.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "30000"

__version__ = "0.1.0"
