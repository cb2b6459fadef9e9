// The verifier's fused CPU operations as the module sssd._kernels (decoder.py calls them).
//
// Tensors are passed as data pointers (`tensor.data_ptr()`) with their sizes: the caller,
// decoder.py, owns the tensors, checks their shapes and dtypes once per step and keeps them
// alive across the call. Every call releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "fused_ops.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace k = sssd::kernels;

namespace {

void* ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

enum class Build { kNone, kAvx2, kAvx512 };

std::atomic<bool> force_avx2{false};  // set_panels_avx2: tests run the AVX2 build anywhere

// The build of the panel products for a dtype code (0 float32, 1 bfloat16) on this CPU.
Build panels_build(int32_t code) {
  static const bool avx512_bf16 = k::has_avx512_bf16(), avx512 = k::has_avx512_fma(),
                    avx2 = k::has_avx2_fma();
  if ((code == 1 ? avx512_bf16 : avx512) && !force_avx2.load()) return Build::kAvx512;
  return avx2 ? Build::kAvx2 : Build::kNone;
}

std::string panels_instructions(int32_t code) {
  const Build build = panels_build(code);
  return build == Build::kAvx512 ? "avx512" : build == Build::kAvx2 ? "avx2" : "";
}

void check_panels(Build build) {
  if (build == Build::kNone) throw nb::value_error("this CPU has neither AVX-512 nor AVX2 + FMA");
}

k::Dtype dtype_of(int32_t code) {
  if (code != 0 && code != 1) throw nb::value_error("dtype code must be 0 (float32) or 1 (bf16)");
  return static_cast<k::Dtype>(code);
}

}  // namespace

NB_MODULE(_kernels, m) {
  m.doc() = "Fused CPU operations of the verifier's decoder layers (RMSNorm, rotary, attention).";
  m.attr("MAX_TREE_NODES") = k::kMaxTreeNodes;
  m.def("has_avx512", &k::has_avx512);
  m.def("set_portable", &k::set_portable, "portable"_a,
        "Turns the vector attention (AVX-512, else AVX2) and the AVX-512 argmax off (True) or "
        "back on; returns the previous setting.");
  m.def("set_attention_avx2", [](bool value) {
    if (value && !k::has_avx2_fma()) throw nb::value_error("this CPU has no AVX2 and FMA");
    return k::set_attention_avx2(value);
  }, "avx2"_a,
        "Runs the tree attention's AVX2 build even where the CPU has AVX-512 (True) or lets the "
        "CPU choose again; returns the previous setting.");
  m.def("set_attention_amx", &k::set_attention_amx, "amx"_a,
        "Lets the AVX-512 tree attention take its bfloat16 scores on the AMX tile unit (True, "
        "the default where the CPU has one) or not; returns the previous setting.");
  m.def("set_attention_dpbf16", &k::set_attention_dpbf16, "dpbf16"_a,
        "Lets the AVX-512 tree attention take its bfloat16 scores with AVX-512 BF16's dot "
        "products (True, the default where the CPU has them and no AMX) or not; returns the "
        "previous setting.");
  m.def("num_threads", &k::num_threads, "OpenMP threads of the parallel loops.");
  m.def("has_avx512_bf16", &k::has_avx512_bf16);
  m.def("packed_bf16_panels", &k::packed_bf16_panels, "out_features"_a);
  m.def("panels_instructions", &panels_instructions, "dtype"_a,
        "Which build of the panel products runs a dtype (0 float32, 1 bfloat16) on this CPU: "
        "'avx512' or 'avx2', or '' where neither can.");
  m.def("set_panels_avx2", [](bool value) {
    if (value && !k::has_avx2_fma()) throw nb::value_error("this CPU has no AVX2 and FMA");
    return force_avx2.exchange(value);
  }, "avx2"_a,
        "Runs the panel products' AVX2 build even where the CPU has AVX-512 (True) or lets the "
        "CPU choose again; returns the previous setting. Weights are packed the same for both.");
  m.def("linear_bf16", [](uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t out,
                          int64_t rows, int64_t in_features, int64_t out_features) {
    const Build build = panels_build(1);
    check_panels(build);
    const auto product = build == Build::kAvx512 ? &k::linear_bf16 : &k::linear_bf16_avx2;
    product(ptr(x), ptr(packed), bias == 0 ? nullptr : ptr(bias), ptr(out), rows, in_features,
            out_features);
  }, nb::call_guard<nb::gil_scoped_release>());
  m.def("read_bytes", [](uintptr_t data, int64_t num_bytes) {
    if (num_bytes % 64 != 0) throw nb::value_error("num_bytes must be a multiple of 64");
    const Build build = panels_build(0);
    check_panels(build);
    return build == Build::kAvx512 ? k::read_bytes(ptr(data), num_bytes)
                                   : k::read_bytes_avx2(ptr(data), num_bytes);
  }, nb::call_guard<nb::gil_scoped_release>(), "Reads the bytes once (a bandwidth probe).");
  m.def("argmax_rows", [](uintptr_t x, int64_t rows, int64_t cols, int32_t dtype,
                          uintptr_t out) {
    k::argmax_rows(ptr(x), rows, cols, dtype_of(dtype), static_cast<int64_t*>(ptr(out)));
  }, nb::call_guard<nb::gil_scoped_release>(),
        "out[r] (int64) = the first index of row r's maximum, as torch.argmax.");
  m.def("move_positions", [](const std::vector<uintptr_t>& buffers, int64_t max_seqs,
                             int64_t num_heads, int64_t capacity, int64_t position_bytes,
                             const std::vector<int64_t>& rows, const std::vector<int64_t>& sources,
                             const std::vector<int64_t>& targets) {
    if (sources.size() != rows.size() || targets.size() != rows.size()) {
      throw nb::value_error("rows, sources and targets must have one entry per move");
    }
    for (size_t i = 0; i < rows.size(); ++i) {
      if (rows[i] < 0 || rows[i] >= max_seqs || sources[i] < 0 || sources[i] >= capacity ||
          targets[i] < 0 || targets[i] >= capacity) {
        throw nb::index_error(("move " + std::to_string(i) + " (slot " +
                               std::to_string(rows[i]) + ", " + std::to_string(sources[i]) +
                               " -> " + std::to_string(targets[i]) +
                               ") lies outside the cache").c_str());
      }
    }
    k::move_positions(buffers, num_heads, capacity, position_bytes, rows, sources, targets);
  }, nb::call_guard<nb::gil_scoped_release>(),
        "The KV cache's commit: moves positions of every buffer, sources read first.");
  m.def("has_amx_bf16", &k::has_amx_bf16);
  m.def("linear_bf16_amx", [](uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t out,
                              int64_t rows, int64_t in_features, int64_t out_features) {
    k::linear_bf16_amx(ptr(x), ptr(packed), bias == 0 ? nullptr : ptr(bias), ptr(out), rows,
                       in_features, out_features);
  }, nb::call_guard<nb::gil_scoped_release>());
  m.def("has_avx512_fma", &k::has_avx512_fma);
  m.def("has_avx2_fma", &k::has_avx2_fma);
  m.def("linear_f32", [](uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t out,
                         int64_t rows, int64_t in_features, int64_t out_features) {
    const Build build = panels_build(0);
    check_panels(build);
    const auto product = build == Build::kAvx512 ? &k::linear_f32 : &k::linear_f32_avx2;
    product(static_cast<const float*>(ptr(x)), static_cast<const float*>(ptr(packed)),
            bias == 0 ? nullptr : static_cast<const float*>(ptr(bias)),
            static_cast<float*>(ptr(out)), rows, in_features, out_features);
  }, nb::call_guard<nb::gil_scoped_release>());
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
  m.def("rope_and_store", [](uintptr_t qkv, uintptr_t cos_table, uintptr_t sin_table,
                             uintptr_t position_ids, uintptr_t q_out, uintptr_t key_cache,
                             uintptr_t value_cache, uintptr_t cache_lens, int64_t first_slot,
                             int64_t num_seqs, int64_t num_nodes, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, int64_t capacity,
                             int32_t dtype) {
    k::rope_and_store(ptr(qkv), ptr(cos_table), ptr(sin_table),
                      static_cast<const int64_t*>(ptr(position_ids)), ptr(q_out),
                      ptr(key_cache), ptr(value_cache),
                      static_cast<const int64_t*>(ptr(cache_lens)), first_slot, num_seqs,
                      num_nodes, heads, kv_heads, head_dim, capacity, dtype_of(dtype));
  }, nb::call_guard<nb::gil_scoped_release>());
  m.def("prompt_attention", [](uintptr_t q, uintptr_t key_cache, uintptr_t value_cache,
                               uintptr_t out, int64_t slot, int64_t length, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, int64_t capacity, float scale,
                               int32_t dtype) {
    return k::prompt_attention(ptr(q), ptr(key_cache), ptr(value_cache), ptr(out), slot, length,
                               heads, kv_heads, head_dim, capacity, scale, dtype_of(dtype));
  }, nb::call_guard<nb::gil_scoped_release>(),
        "Causal attention of a prompt over its own keys; False where it does not apply.");
  m.def("attention", [](uintptr_t q, uintptr_t key_cache, uintptr_t value_cache,
                        uintptr_t cache_lens, uintptr_t tree_bits, uintptr_t out,
                        int64_t first_slot, int64_t num_seqs, int64_t num_nodes, int64_t heads,
                        int64_t kv_heads, int64_t head_dim, int64_t capacity, float scale,
                        int32_t dtype) {
    k::attention(ptr(q), ptr(key_cache), ptr(value_cache),
                 static_cast<const int64_t*>(ptr(cache_lens)),
                 static_cast<const uint64_t*>(ptr(tree_bits)), ptr(out), first_slot, num_seqs,
                 num_nodes, heads, kv_heads, head_dim, capacity, scale, dtype_of(dtype));
  }, nb::call_guard<nb::gil_scoped_release>());
}
