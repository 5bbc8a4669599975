// CPU kernels for pagedserve: the same semantics as kernels/reference.py, without the
// temporaries PyTorch ops need. Paged attention reads each key and value straight from its
// block (the reference gathers every block into a copy first), and the
// element-wise ops do in one pass what eager PyTorch does in five to ten.
//
// Built on first use by kernels/cpu/__init__.py (torch.utils.cpp_extension); every op works
// on float32 and bfloat16 with float32 arithmetic inside (linear_f32: float32 only). Threads: at::parallel_for, so
// torch.set_num_threads applies. Sources: attention.cpp, paged.cpp, elementwise.cpp,
// linear.cpp, common.h.

// pybind11 and its at::Tensor conversions; the kernels' files need no Python.
#include <torch/csrc/utils/pybind.h>

#include "common.h"

using namespace pagedserve_cpu;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The long kernels (milliseconds per layer) let go of the GIL, as PyTorch's own ops
  // do, so that a server's event loop can stream tokens meanwhile instead of idling the
  // engine thread when it takes the GIL back. They touch no Python objects.
  using release_gil = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention, release_gil());
  m.def("paged_prefill_attention", &paged_prefill_attention, release_gil());
  m.def("gather_kv", &gather_kv, release_gil());
  m.def("linear_f32", &linear_f32, release_gil());
  m.def("pack_linear_f32", &pack_linear_f32, release_gil());
  m.def("has_linear_f32", &has_linear_f32);
  m.def("store_kvcache", &store_kvcache);
  m.def("decode_layout_ok", &decode_layout_ok);
  m.def("rms_norm", &rms_norm);
  m.def("rope_", &rope_);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("argmax_rows", &argmax_rows);
}
