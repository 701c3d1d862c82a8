// Python bindings of the CPU kernels (the launchers in launch.py validate and call these).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("codec_attention", &fc::codec_attention, "flashcodec::codec_attention on the stored form",
        py::arg("q"), py::arg("k_state"), py::arg("v_state"), py::arg("k_plan"), py::arg("v_plan"), py::arg("k_new"),
        py::arg("v_new"), py::arg("mask"), py::arg("scale"), py::arg("simd"), py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none(), py::arg("alibi") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("codec_attention_plans", &fc::codec_attention_plans, "codec_attention with registered plans",
        py::arg("q"), py::arg("k_state"), py::arg("v_state"), py::arg("k_plan"), py::arg("v_plan"), py::arg("k_new"),
        py::arg("v_new"), py::arg("mask"), py::arg("scale"), py::arg("simd"), py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none(), py::arg("alibi") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("register_plan", &fc::register_plan, "register a codec plan (plan.Plan's tensors): its number");
  m.def("append_plan", &fc::append_plan, "flashcodec::append with a registered plan",
        py::call_guard<py::gil_scoped_release>());
  py::class_<fc::AppendAttention>(m, "AppendAttention", "flashcodec::append_attention of one pair of codecs")
      .def(py::init<>())
      .def("admit", &fc::AppendAttention::admit, "remember a validated layout with its plans")
      .def("__call__", &fc::AppendAttention::call, "one step, or None (nothing changed) where the launcher decides");
  m.def("attention_workspace", &fc::attention_workspace, "floats of codec_attention's workspace");
  m.def("attention_path", &fc::attention_path, "which kernel serves a (key, value) codec pair");
  m.def("simd_isa", &fc::simd_isa, "the SIMD code compiled in: avx512, avx2 or portable");
  m.def("append", &fc::append, "flashcodec::append", py::call_guard<py::gil_scoped_release>());
  m.def("serial_blas", &fc::serial_blas_available, "whether BLAS calls can be kept on the calling thread (MKL)");
  m.def("sum_probe", &fc::sum_probe, "row and column sums in torch's order for a vector width");
}
