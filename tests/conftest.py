# Must run before anything imports triton kernels: @triton.jit reads TRITON_INTERPRET when the
# defining module is imported, and without a GPU the interpreter is the only way to run them.
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
