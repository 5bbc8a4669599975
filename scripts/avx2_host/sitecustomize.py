"""Make PyTorch report no AVX-512 and no AMX to the process, as on an AVX2-only CPU.

`scripts/ab_peer.sh` puts this folder on the peer's PYTHONPATH when AB_HOLD_AVX2=1. The
environment caps (ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS, ATEN_CPU_CAPABILITY) hold
oneDNN, MKL and inductor to AVX2, but vLLM's CPU build picks its own kernel library
(`_C_AVX2`, `_C_AVX512` or the AVX-512 BF16 `_C`) and attention backend from
`torch.cpu._is_avx512_supported()` and its siblings, which read the hardware. Python runs
this module at start-up in every process, vLLM's engine process included; it patches
`torch.cpu` when that module is first imported, so torch itself still loads when vLLM
imports it."""

import importlib.abc
import importlib.machinery
import sys

_HIDDEN = ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
           "_is_amx_tile_supported", "_is_amx_fp16_supported")


class _HideWideVectors(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:  # noqa: ANN001
            run(module)
            for attr in _HIDDEN:
                if hasattr(module, attr):
                    setattr(module, attr, lambda: False)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _HideWideVectors())
