// GGUF tensors kept as the file stores them (rows of ggml blocks), multiplied through ggml's own
// CPU dot products (libggml-cpu, built by scripts/build_ggml.sh): every activation row is converted
// to the weight type's `vec_dot_type` on its own (Q8_0 / Q8_1 / Q8_K blocks, or F16 / BF16), then
// each output is one `vec_dot` of a weight row with an activation row. So each row's result depends
// on that row alone, whatever the number of rows (no batch-wide scales, no row-count switch).
//
//   gemm(x float32 [T, K], w uint8 [N, row_bytes], type, K) -> y float32 [T, N]
//   dequantize(w uint8 [R, row_bytes], type, K) -> float32 [R, K]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ggml.h"
#include "ggml-cpu.h"

namespace {

// Weight rows a task takes at once (their bytes stay in L1/L2 while the task walks its activation
// rows) and activation rows a tile holds (quantized rows reused across the task's weight rows).
constexpr int64_t ROWS_PER_TASK = 16;
constexpr int64_t ACT_TILE = 64;

const ggml_type_traits_cpu* traits_of(int64_t type, int64_t k) {
  TORCH_CHECK(type >= 0 && type < GGML_TYPE_COUNT, "unknown ggml type ", type);
  const auto t = static_cast<ggml_type>(type);
  const ggml_type_traits_cpu* tc = ggml_get_type_traits_cpu(t);
  TORCH_CHECK(tc != nullptr && tc->vec_dot != nullptr, "ggml has no CPU dot product for type ", ggml_type_name(t));
  TORCH_CHECK(k % ggml_blck_size(t) == 0, ggml_type_name(t), " rows need K divisible by ",
              ggml_blck_size(t), ", got ", k);
  const ggml_type_traits_cpu* act = ggml_get_type_traits_cpu(tc->vec_dot_type);
  TORCH_CHECK(tc->vec_dot_type == GGML_TYPE_F32 || (act != nullptr && act->from_float != nullptr),
              "ggml cannot convert activations for ", ggml_type_name(t));
  TORCH_CHECK(k % ggml_blck_size(tc->vec_dot_type) == 0, ggml_type_name(t), ": K ", k,
              " is not a whole number of ", ggml_type_name(tc->vec_dot_type), " blocks");
  return tc;
}

void check_weights(const torch::Tensor& w, int64_t type, int64_t k) {
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "weights must be a contiguous uint8 [rows, row_bytes] tensor");
  const size_t row_bytes = ggml_row_size(static_cast<ggml_type>(type), k);
  TORCH_CHECK(static_cast<size_t>(w.size(1)) == row_bytes, ggml_type_name(static_cast<ggml_type>(type)),
              " rows of ", k, " values take ", row_bytes, " bytes, got ", w.size(1));
}

}  // namespace

// y [T, sum N_p] = x [T, K] times parts p of weights (each its own ggml type, K columns); part p's
// stored row r writes output column offset_p + cols_p[r] (cols_p empty: r), so a fused q/k/v whose
// rows the file stores permuted (llama.cpp's rope layout) runs on the file's bytes as they are.
// Activations are converted once per distinct `vec_dot_type` among the parts.
torch::Tensor gemm_parts(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> types,
                         std::vector<torch::Tensor> cols, int64_t k) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) == k,
              "x must be float32 [T, ", k, "]");
  const size_t P = ws.size();
  TORCH_CHECK(P > 0 && types.size() == P && cols.size() == P, "one type and one column map per part");
  x = x.contiguous();
  const int64_t T = x.size(0);
  std::vector<const ggml_type_traits_cpu*> tcs(P);
  std::vector<int64_t> offset(P + 1, 0);
  for (size_t p = 0; p < P; ++p) {
    tcs[p] = traits_of(types[p], k);
    check_weights(ws[p], types[p], k);
    const int64_t n = ws[p].size(0);
    if (cols[p].numel() > 0) {
      TORCH_CHECK(cols[p].scalar_type() == torch::kInt64 && cols[p].dim() == 1 && cols[p].numel() == n &&
                  cols[p].is_contiguous(), "a part's column map must be int64 [rows]");
      const int64_t* c = cols[p].data_ptr<int64_t>();  // a plain scan: no tensor ops on the step's path
      for (int64_t r = 0; r < n; ++r)
        TORCH_CHECK(c[r] >= 0 && c[r] < n, "a part's column map must hold columns in [0, rows)");
    }
    offset[p + 1] = offset[p] + n;
  }
  const int64_t N = offset[P];
  auto y = torch::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  const float* xf = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();

  // activations in each dot product's type, row by row (each row on its own scales)
  std::vector<torch::Tensor> bufs;
  std::vector<const uint8_t*> xq(P, reinterpret_cast<const uint8_t*>(xf));
  std::vector<size_t> x_row(P);
  for (size_t p = 0; p < P; ++p) {
    const ggml_type vt = tcs[p]->vec_dot_type;
    x_row[p] = ggml_row_size(vt, k);
    if (vt == GGML_TYPE_F32) continue;
    size_t same = p;
    for (size_t q = 0; q < p; ++q) if (tcs[q]->vec_dot_type == vt) { same = q; break; }
    if (same != p) { xq[p] = xq[same]; continue; }
    bufs.push_back(torch::empty({T, static_cast<int64_t>(x_row[p])}, torch::kUInt8));
    uint8_t* dst = bufs.back().data_ptr<uint8_t>();
    const ggml_from_float_t from_float = ggml_get_type_traits_cpu(vt)->from_float;
    const size_t row = x_row[p];
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) from_float(xf + t * k, dst + t * row, k);
    });
    xq[p] = dst;
  }

  // tasks: ROWS_PER_TASK weight rows of one part
  std::vector<int64_t> task_start(P + 1, 0);
  for (size_t p = 0; p < P; ++p)
    task_start[p + 1] = task_start[p] + (ws[p].size(0) + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  at::parallel_for(0, task_start[P], 1, [&](int64_t b0, int64_t b1) {
    for (int64_t t0 = 0; t0 < T; t0 += ACT_TILE) {
      const int64_t t1 = std::min(T, t0 + ACT_TILE);
      for (int64_t b = b0; b < b1; ++b) {
        size_t p = 0;
        while (task_start[p + 1] <= b) ++p;
        const int64_t n_p = ws[p].size(0);
        const int64_t r0 = (b - task_start[p]) * ROWS_PER_TASK, r1 = std::min(n_p, r0 + ROWS_PER_TASK);
        const uint8_t* wp = ws[p].data_ptr<uint8_t>();
        const size_t w_row = static_cast<size_t>(ws[p].size(1));
        const int64_t* col = cols[p].numel() > 0 ? cols[p].data_ptr<int64_t>() : nullptr;
        const ggml_vec_dot_t vec_dot = tcs[p]->vec_dot;
        for (int64_t r = r0; r < r1; ++r) {
          const uint8_t* wr = wp + r * w_row;
          float* out = yp + offset[p] + (col ? col[r] : r);
          for (int64_t t = t0; t < t1; ++t) {
            vec_dot(static_cast<int>(k), out + t * N, 0, wr, 0, xq[p] + t * x_row[p], 0, 1);
          }
        }
      }
    }
  });
  return y;
}

torch::Tensor gemm(torch::Tensor x, torch::Tensor w, int64_t type, int64_t k) {
  return gemm_parts(x, {w}, {type}, {torch::empty({0}, torch::kInt64)}, k);
}

torch::Tensor dequantize(torch::Tensor w, int64_t type, int64_t k) {
  TORCH_CHECK(type >= 0 && type < GGML_TYPE_COUNT, "unknown ggml type ", type);
  const auto t = static_cast<ggml_type>(type);
  const ggml_type_traits* tr = ggml_get_type_traits(t);
  TORCH_CHECK(tr != nullptr && (tr->to_float != nullptr || t == GGML_TYPE_F32), "ggml cannot dequantize ",
              ggml_type_name(t));
  check_weights(w, type, k);
  const int64_t R = w.size(0);
  auto y = torch::empty({R, k}, torch::kFloat32);
  const size_t w_row = static_cast<size_t>(w.size(1));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (t == GGML_TYPE_F32) std::memcpy(yp + r * k, wp + r * w_row, k * sizeof(float));
      else tr->to_float(wp + r * w_row, yp + r * k, k);
    }
  });
  return y;
}

// x float32 [R, K] -> uint8 [R, row_bytes]: ggml's own quantization of each row to `type` (what
// llama-quantize writes; for making test files and for float checkpoints kept in a ggml type)
torch::Tensor quantize(torch::Tensor x, int64_t type) {
  TORCH_CHECK(type >= 0 && type < GGML_TYPE_COUNT, "unknown ggml type ", type);
  const auto t = static_cast<ggml_type>(type);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x must be float32 [rows, K]");
  TORCH_CHECK(!ggml_quantize_requires_imatrix(t), ggml_type_name(t), " needs an importance matrix");
  const int64_t R = x.size(0), K = x.size(1);
  TORCH_CHECK(K % ggml_blck_size(t) == 0, ggml_type_name(t), " rows need K divisible by ", ggml_blck_size(t));
  x = x.contiguous();
  auto out = torch::empty({R, static_cast<int64_t>(ggml_row_size(t, K))}, torch::kUInt8);
  ggml_quantize_init(t);
  ggml_quantize_chunk(t, x.data_ptr<float>(), out.data_ptr<uint8_t>(), 0, R, K, nullptr);
  return out;
}

std::string type_name(int64_t type) {
  TORCH_CHECK(type >= 0 && type < GGML_TYPE_COUNT, "unknown ggml type ", type);
  return ggml_type_name(static_cast<ggml_type>(type));
}

int64_t row_bytes(int64_t type, int64_t k) {
  TORCH_CHECK(type >= 0 && type < GGML_TYPE_COUNT, "unknown ggml type ", type);
  return static_cast<int64_t>(ggml_row_size(static_cast<ggml_type>(type), k));
}

std::string vec_dot_type(int64_t type) {
  const ggml_type_traits_cpu* tc = ggml_get_type_traits_cpu(static_cast<ggml_type>(type));
  return ggml_type_name(tc->vec_dot_type);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  ggml_cpu_init();  // ggml's float16 tables and CPU feature probe, once per process
  namespace py = pybind11;
  m.def("gemm", &gemm, "y [T, N] = x [T, K] float32 times a GGUF tensor's rows (uint8 [N, row_bytes]) of a ggml type",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_parts", &gemm_parts, "y [T, sum N_p] = x [T, K] float32 times parts of weights, each its own ggml type",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &dequantize, "float32 [R, K] values of R stored rows of a ggml type",
        py::call_guard<py::gil_scoped_release>());
  m.def("quantize", &quantize, "uint8 [R, row_bytes]: float32 rows [R, K] quantized by ggml to a type",
        py::call_guard<py::gil_scoped_release>());
  m.def("type_name", &type_name);
  m.def("row_bytes", &row_bytes);
  m.def("vec_dot_type", &vec_dot_type, "the type ggml converts activations to for this weight type");
}
