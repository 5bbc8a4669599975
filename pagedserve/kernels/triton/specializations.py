"""The Triton kernel builds a CUDA run would need, read off interpreted launches on a CPU.

Triton's JIT builds a kernel once per specialization of its arguments (common.py,
VARYING_ARGS); the interpreter builds nothing, so it cannot say when a build would happen.
SpecializationRecorder computes, for each interpreted launch, the key the JIT would compute
for the same launch on a GPU (its argument binder, with the CUDA backend's rules) and keeps
the distinct ones per kernel. Used by tests/test_triton_warm_up.py and
scripts/count_triton_builds.py; it reads Triton internals (triton==3.7.1, the pin)."""

import contextlib
import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator

from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import KernelParam, create_function_from_signature

Key = tuple[tuple[str, ...], tuple]


class SpecializationRecorder:
    """``seen``: kernel name -> the specializations its launches would build for."""

    def __init__(self) -> None:
        self.seen: dict[str, set[Key]] = defaultdict(set)
        self._binders: dict[InterpretedFunction, Callable] = {}

    def key(self, kernel: InterpretedFunction, args: tuple, kwargs: dict) -> Key:
        binder = self._binders.get(kernel)
        if binder is None:
            never = {option: kernel.kwargs.get(option) or () for option in
                     ("do_not_specialize", "do_not_specialize_on_alignment")}
            signature = inspect.signature(kernel.fn)
            params = [KernelParam(i, p, p.name in never["do_not_specialize"],
                                  p.name in never["do_not_specialize_on_alignment"])
                      for i, p in enumerate(signature.parameters.values())]
            binder = self._binders[kernel] = create_function_from_signature(
                signature, params, CUDABackend)
        _, specialization, options = binder(*args, **kwargs)
        return tuple(map(str, specialization)), tuple(sorted(options.items()))

    @contextlib.contextmanager
    def recording(self) -> Iterator["SpecializationRecorder"]:
        """Records every interpreted launch meanwhile."""
        launch = InterpretedFunction.run

        def recording_run(kernel, *args, grid, warmup, **kwargs):
            self.seen[kernel.fn.__name__].add(self.key(kernel, args, kwargs))
            return launch(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = recording_run
        try:
            yield self
        finally:
            InterpretedFunction.run = launch

    def snapshot(self) -> dict[str, set[Key]]:
        return {name: set(keys) for name, keys in self.seen.items()}

    def new_since(self, before: dict[str, set[Key]]) -> dict[str, int]:
        """Kernel name -> how many specializations were first met after ``before``."""
        counts = {name: len(keys - before.get(name, set())) for name, keys in self.seen.items()}
        return {name: n for name, n in counts.items() if n}
