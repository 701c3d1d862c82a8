// Python bindings of the paged kernels (vllm/kernels.py validates and calls these); sum_probe: launch.sum_width.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("paged_store", &fc::paged_store, "store into vLLM pages", py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill", &fc::paged_prefill, "attention of long prefill chunks on vLLM pages",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &fc::paged_attention, "attention on vLLM pages", py::call_guard<py::gil_scoped_release>());
  m.def("sum_probe", &fc::sum_probe, "row and column sums in torch's order for a vector width");
}
