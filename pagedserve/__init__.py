"""pagedserve: a paged-attention LLM serving backend."""

import os

# Idle OpenMP threads must sleep, not spin: on small shared hosts (2 vCPUs) spinning
# threads steal the core a matmul needs and make small steps 10-20x slower. Only takes
# effect if set before torch starts its thread pool, hence here, at package import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
