// sssd._kernels: the CPU operations of the project's forward pass (decoder.py calls them), the
// only place that knows Python.
//
// Tensors are passed as data pointers (`tensor.data_ptr()`) with their sizes: the caller owns
// the tensors, checks their shapes and dtypes and keeps them alive across the call. The KV cache
// is described once by a `KvLayout` and a step's rows by a `StepRows` (kv_layout.h), both
// checked when made. Every call releases the GIL. Which implementation each call runs:
// `kernel_path`, chosen once from the CPU's features (cpu_paths.h), `force_path` for tests.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cpu_paths.h"
#include "kernels.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace k = sssd::kernels;

namespace {

void* ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

template <typename T>
const T* cptr(uintptr_t address) {
  return reinterpret_cast<const T*>(address);
}

k::Dtype dtype_of(int32_t code) {
  if (code != 0 && code != 1) throw nb::value_error("dtype code must be 0 (float32) or 1 (bf16)");
  return static_cast<k::Dtype>(code);
}

// The panels' build for a dtype, or an error where this CPU has none.
k::Path panels(k::Dtype dtype) {
  const k::Path path = k::path_of(k::Kernel::kPanels, dtype);
  if (path == k::Path::kNone) throw nb::value_error("this CPU has neither AVX-512 nor AVX2 + FMA");
  return path;
}

// StepRows as Python makes them: checked against the cache they index.
struct Rows : k::StepRows {};

}  // namespace

NB_MODULE(_kernels, m) {
  m.doc() = "CPU operations of the project's forward pass: products, norms, rotary, attention.";
  m.attr("MAX_TREE_NODES") = k::kMaxTreeNodes;
  m.attr("KERNELS") = nb::make_tuple("tree_attention", "attention_scores", "panels", "argmax");

  // --- the kernel paths --------------------------------------------------------------------
  m.def("cpu_features", [] {
    const k::CpuFeatures& cpu = k::cpu_features();
    nb::dict features;
    features["avx2_fma"] = cpu.avx2_fma;
    features["avx512"] = cpu.avx512;
    features["avx512_bf16"] = cpu.avx512_bf16;
    features["amx_bf16"] = cpu.amx_bf16;
    return features;
  }, "What this CPU (and its OS, for AMX) offers, as the kernels read it once.");
  m.def("kernel_path", [](const std::string& kernel, int32_t dtype) {
    for (int32_t i = 0; i < k::kNumKernels; ++i) {
      const auto which = static_cast<k::Kernel>(i);
      if (kernel == k::kernel_name(which)) return std::string(k::path_name(
          k::path_of(which, dtype_of(dtype))));
    }
    throw nb::value_error(("unknown kernel " + kernel).c_str());
  }, "kernel"_a, "dtype"_a, "The path a kernel runs for a dtype (0 float32, 1 bfloat16) now.");
  m.def("force_path", [](const std::string& kernel, const std::string& path) {
    try {
      return k::force_path(kernel, path);
    } catch (const std::invalid_argument& error) {
      throw nb::value_error(error.what());
    }
  }, "kernel"_a, "path"_a,
        "Forces a kernel's path for every dtype ('' lets the CPU choose again); returns the "
        "previously forced one. For tests and benchmarks that compare paths.");
  m.def("num_threads", &k::num_threads, "OpenMP threads of the parallel loops.");
  m.def("has_amx_bf16", &k::has_amx_bf16);

  // --- the KV cache and a step's rows ------------------------------------------------------
  nb::class_<k::KvLayout>(m, "KvLayout",
                          "A cache's buffers and shape: every layer's keys and values, each "
                          "[num_blocks, kv_heads, block_size, head_dim] of the dtype.")
      .def("__init__", [](k::KvLayout* self, std::vector<uintptr_t> keys,
                          std::vector<uintptr_t> values, int64_t num_blocks, int64_t block_size,
                          int64_t kv_heads, int64_t head_dim, int32_t dtype) {
        k::KvLayout layout{std::move(keys), std::move(values), num_blocks, block_size, kv_heads,
                           head_dim, dtype_of(dtype)};
        try {
          k::check_layout(layout);
        } catch (const std::invalid_argument& error) {
          throw nb::value_error(error.what());
        }
        new (self) k::KvLayout(std::move(layout));
      }, "keys"_a, "values"_a, "num_blocks"_a, "block_size"_a, "kv_heads"_a, "head_dim"_a,
           "dtype"_a)
      .def_ro("num_blocks", &k::KvLayout::num_blocks)
      .def_ro("block_size", &k::KvLayout::block_size);
  nb::class_<Rows>(m, "StepRows",
                   "The rows of one step: cache_lens [num_seqs] int64, block_tables [num_seqs, "
                   "max_blocks] int32, tree_bits [num_seqs, num_nodes] (0: chains), "
                   "position_ids [num_seqs * num_nodes] int64; checked against the layout.")
      .def("__init__", [](Rows* self, const k::KvLayout& layout, int64_t num_seqs,
                          int64_t num_nodes, uintptr_t cache_lens, uintptr_t block_tables,
                          int64_t max_blocks, uintptr_t tree_bits, uintptr_t position_ids) {
        Rows rows;
        rows.num_seqs = num_seqs;
        rows.num_nodes = num_nodes;
        rows.cache_lens = cptr<int64_t>(cache_lens);
        rows.block_tables = cptr<int32_t>(block_tables);
        rows.max_blocks = max_blocks;
        rows.tree_bits = tree_bits == 0 ? nullptr : cptr<uint64_t>(tree_bits);
        rows.position_ids = cptr<int64_t>(position_ids);
        try {
          k::check_rows(layout, rows);
        } catch (const std::invalid_argument& error) {
          throw nb::value_error(error.what());
        }
        new (self) Rows(rows);
      }, "layout"_a, "num_seqs"_a, "num_nodes"_a, "cache_lens"_a, "block_tables"_a,
           "max_blocks"_a, "tree_bits"_a, "position_ids"_a);

  m.def("rope_and_store", [](const k::KvLayout& cache, int64_t layer, const Rows& rows,
                             uintptr_t qkv, uintptr_t cos_table, uintptr_t sin_table,
                             uintptr_t q_out, int64_t heads) {
    k::rope_and_store(cache, layer, rows, ptr(qkv), ptr(cos_table), ptr(sin_table), ptr(q_out),
                      heads);
  }, nb::call_guard<nb::gil_scoped_release>(), "cache"_a, "layer"_a, "rows"_a, "qkv"_a,
        "cos_table"_a, "sin_table"_a, "q_out"_a, "heads"_a);
  m.def("attention", [](const k::KvLayout& cache, int64_t layer, const Rows& rows, uintptr_t q,
                        uintptr_t out, int64_t heads, float scale) {
    k::attention(cache, layer, rows, ptr(q), ptr(out), heads, scale);
  }, nb::call_guard<nb::gil_scoped_release>(), "cache"_a, "layer"_a, "rows"_a, "q"_a, "out"_a,
        "heads"_a, "scale"_a);
  m.def("move_positions", [](const k::KvLayout& cache, const std::vector<int64_t>& sources,
                             const std::vector<int64_t>& targets) {
    try {
      k::move_positions(cache, sources, targets);
    } catch (const std::out_of_range& error) {
      throw nb::index_error(error.what());
    }
  }, nb::call_guard<nb::gil_scoped_release>(), "cache"_a, "sources"_a, "targets"_a,
        "The KV cache's commit: moves cache positions (block * block_size + offset) of every "
        "layer, sources read first.");

  // --- the layer's other operations ----------------------------------------------------------
  m.def("rms_norm", [](uintptr_t x, uintptr_t w, uintptr_t out, int64_t rows, int64_t dim,
                       float eps, int32_t dtype) {
    k::rms_norm(ptr(x), ptr(w), ptr(out), rows, dim, eps, dtype_of(dtype));
  }, nb::call_guard<nb::gil_scoped_release>());
  m.def("add_rms_norm", [](uintptr_t x, uintptr_t y, uintptr_t w, uintptr_t out, int64_t rows,
                           int64_t dim, float eps, int32_t dtype) {
    k::add_rms_norm(ptr(x), ptr(y), ptr(w), ptr(out), rows, dim, eps, dtype_of(dtype));
  }, nb::call_guard<nb::gil_scoped_release>());
  m.def("silu_mul", [](uintptr_t gate_up, uintptr_t out, int64_t rows, int64_t inter,
                       int32_t dtype) {
    k::silu_mul(ptr(gate_up), ptr(out), rows, inter, dtype_of(dtype));
  }, nb::call_guard<nb::gil_scoped_release>());
  m.def("argmax_rows", [](uintptr_t x, int64_t rows, int64_t cols, int32_t dtype,
                          uintptr_t out) {
    k::argmax_rows(ptr(x), rows, cols, dtype_of(dtype), static_cast<int64_t*>(ptr(out)));
  }, nb::call_guard<nb::gil_scoped_release>(),
        "out[r] (int64) = the first index of row r's maximum, as torch.argmax.");

  // --- the matrix products -----------------------------------------------------------------
  m.def("packed_bf16_panels", &k::packed_bf16_panels, "out_features"_a);
  m.def("linear_bf16", [](uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t out,
                          int64_t rows, int64_t in_features, int64_t out_features) {
    const auto product = panels(k::Dtype::kBFloat16) == k::Path::kAvx512 ? &k::linear_bf16
                                                                          : &k::linear_bf16_avx2;
    product(ptr(x), ptr(packed), bias == 0 ? nullptr : ptr(bias), ptr(out), rows, in_features,
            out_features);
  }, nb::call_guard<nb::gil_scoped_release>());
  m.def("linear_f32", [](uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t out,
                         int64_t rows, int64_t in_features, int64_t out_features) {
    const auto product = panels(k::Dtype::kFloat32) == k::Path::kAvx512 ? &k::linear_f32
                                                                        : &k::linear_f32_avx2;
    product(cptr<float>(x), cptr<float>(packed), bias == 0 ? nullptr : cptr<float>(bias),
            static_cast<float*>(ptr(out)), rows, in_features, out_features);
  }, nb::call_guard<nb::gil_scoped_release>());
  m.def("linear_bf16_amx", [](uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t out,
                              int64_t rows, int64_t in_features, int64_t out_features) {
    k::linear_bf16_amx(ptr(x), ptr(packed), bias == 0 ? nullptr : ptr(bias), ptr(out), rows,
                       in_features, out_features);
  }, nb::call_guard<nb::gil_scoped_release>());
  m.def("read_bytes", [](uintptr_t data, int64_t num_bytes) {
    if (num_bytes % 64 != 0) throw nb::value_error("num_bytes must be a multiple of 64");
    return panels(k::Dtype::kFloat32) == k::Path::kAvx512
               ? k::read_bytes(ptr(data), num_bytes)
               : k::read_bytes_avx2(ptr(data), num_bytes);
  }, nb::call_guard<nb::gil_scoped_release>(), "Reads the bytes once (a bandwidth probe).");
}
