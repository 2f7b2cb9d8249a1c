// A decode step's transformer layers in one C++ call, on forklm's CPU kernels: per layer the block
// kernel's q/k/v product (RMSNorm fused), the C++ attention (rotary, K/V write, attention), the o
// product (residual fused), the gate/up product (RMSNorm fused) and the down product (SwiGLU and
// residual fused): the same functions with the same arguments as the model's Python loop calls one
// by one (llama.py), so the result is the same bit for bit; what goes is ~150 calls a step from
// Python into C++ and the Python between them.
//
// The weights are handed over once (`DecodeStack`, built by kernels/decode_stack.py); a step passes
// the activations, the caches and the attention plan.

#define FORKLM_EMBEDDED 1  // the two kernels' sources below without their Python modules
#include "block_gemm.cpp"
#include "paged_attention.cpp"

#include <map>
#include <string>

namespace {

// One run of a product's output columns: the kernel's layout `kind` and its arrays in the order
// `gemm_<kind>` takes them (block_gemm.py: BlockWeights.kernel_arrays).
struct BlockPart {
  std::string kind;
  std::vector<torch::Tensor> a;
  int64_t outputs = 0;  // its output columns (`part_outputs`, set once when the stack is built)

  torch::Tensor run(const torch::Tensor& x, Prologue mode, const std::optional<torch::Tensor>& norm, double eps,
                    const std::optional<torch::Tensor>& r) const {
    if (kind == "q4_1") return gemm<true>(x, a[0], a[1], a[2], mode, norm, eps, r);
    if (kind == "q4_0_r8") return gemm_r8<R8_Q4_0>(x, a[0], a[0], a[1], a[1], a[2], mode, norm, eps, r);
    if (kind == "q4_1_r8") return gemm_r8<R8_Q4_1>(x, a[0], a[0], a[1], a[2], a[3], mode, norm, eps, r);
    if (kind == "q5_0_r8") return gemm_r8<R8_Q5_0>(x, a[0], a[1], a[2], a[2], a[3], mode, norm, eps, r);
    if (kind == "q5_1_r8") return gemm_r8<R8_Q5_1>(x, a[0], a[1], a[2], a[3], a[4], mode, norm, eps, r);
    if (kind == "q8_0_r8") return gemm_r8<R8_Q8_0>(x, a[0], a[0], a[1], a[1], a[2], mode, norm, eps, r);
    if (kind == "iq4_nl_r8") return gemm_r8<R8_IQ4_NL>(x, a[0], a[0], a[1], a[1], a[2], mode, norm, eps, r);
    if (kind == "q4_k_r8") return gemm_r8<R8_Q4_K>(x, a[0], a[0], a[1], a[4], a[5], mode, norm, eps, r, a[2], a[3]);
    if (kind == "q6_k_r8") return gemm_r8<R8_Q6_K>(x, a[0], a[1], a[2], a[2], a[4], mode, norm, eps, r, a[3], a[3]);
    if (kind == "q5_k_r8") return gemm_r8<R8_Q5_K>(x, a[0], a[1], a[2], a[5], a[6], mode, norm, eps, r, a[3], a[4]);
    if (kind == "q5_1") return gemm<true, true>(x, a[0], a[2], a[3], mode, norm, eps, r, a[1]);
    if (kind == "q4_k") return gemm<true, false, true>(x, a[0], a[1], a[3], mode, norm, eps, r, torch::Tensor(), a[2], a[4]);
    if (kind == "q5_k") return gemm<true, true, true>(x, a[0], a[2], a[4], mode, norm, eps, r, a[1], a[3], a[5]);
    if (kind == "q6_k") return gemm<false, false, false, SUB16_Q6>(x, a[0], a[2], a[2], mode, norm, eps, r, a[1], a[3]);
    if (kind == "q3_k") return gemm<false, false, false, SUB16_Q3>(x, a[0], a[2], a[2], mode, norm, eps, r, a[1], a[3]);
    if (kind == "q2_k") return gemm<false, false, false, SUB16_Q2>(x, a[0], a[1], a[1], mode, norm, eps, r, torch::Tensor(), a[2]);
    if (kind == "iq4_xs") return gemm<false, false, false, SUB16_IQ4XS>(x, a[0], a[1], a[1], mode, norm, eps, r, torch::Tensor(), a[2]);
    if (kind == "iq4_nl") return gemm<false, false, false, NO_SUB16, true>(x, a[0], a[1], a[1], mode, norm, eps, r);
    if (kind == "bf16") return gemm_half<true>(x, a[0], mode, norm, eps, r);
    if (kind == "f16") return gemm_half<false>(x, a[0], mode, norm, eps, r);
    return gemm<false>(x, a[0], a[1], a[1], mode, norm, eps, r);  // q8_0
  }
};

// A part's output count: its arrays' rows, but for the interleaved layouts (rows are groups of 8
// outputs there) the count they carry.
int64_t part_outputs(const BlockPart& p) {
  if (p.kind.size() > 3 && p.kind.compare(p.kind.size() - 3, 3, "_r8") == 0) return *p.a.back().data_ptr<int64_t>();
  return p.a[0].size(0);
}

// A product's weights: one part, or parts of different layouts side by side along the outputs, run
// one after the other into their columns (as quant.py's BlockLinear.kernel does).
struct BlockMatrix {
  std::vector<BlockPart> parts;

  torch::Tensor run(const torch::Tensor& x, Prologue mode, const std::optional<torch::Tensor>& norm, double eps,
                    const std::optional<torch::Tensor>& r) const {
    if (parts.size() == 1) return parts[0].run(x, mode, norm, eps, r);
    std::vector<torch::Tensor> outs;
    int64_t first = 0;
    for (const BlockPart& p : parts) {
      const int64_t width = p.outputs;
      std::optional<torch::Tensor> rp;
      if (r.has_value()) rp = r->narrow(1, first, width);
      outs.push_back(p.run(x, mode, norm, eps, rp));
      first += width;
    }
    return torch::cat(outs, 1);
  }
};

struct Layer {
  torch::Tensor attn_norm, mlp_norm;
  BlockMatrix qkv, o, gate_up, down;
  std::optional<torch::Tensor> qkv_bias;  // [(h + 2g)·D] float32 (Qwen2), added after the product
};

class DecodeStack {
 public:
  // norms [2L]: attn_norm, mlp_norm per layer; kinds / arrays [4L]: qkv, o, gate_up, down per layer,
  // each a list of its parts
  DecodeStack(const std::vector<torch::Tensor>& norms, const std::vector<std::vector<std::string>>& kinds,
              const std::vector<std::vector<std::vector<torch::Tensor>>>& arrays, double eps, int64_t num_heads,
              const std::vector<std::optional<torch::Tensor>>& qkv_bias)
      : eps_(eps), num_heads_(num_heads) {
    const size_t L = norms.size() / 2;
    TORCH_CHECK(norms.size() == 2 * L && kinds.size() == 4 * L && arrays.size() == 4 * L,
                "a decode stack needs 2 norms and 4 block matrices per layer");
    const std::map<std::string, size_t> arity{{"q4_1", 3}, {"q4_0_r8", 3}, {"q4_1_r8", 4}, {"q5_0_r8", 4}, {"q5_1_r8", 5}, {"q8_0_r8", 3}, {"iq4_nl_r8", 3}, {"q4_k_r8", 6}, {"q5_k_r8", 7}, {"q6_k_r8", 5}, {"q5_1", 4}, {"q4_k", 5}, {"q5_k", 6}, {"q6_k", 4}, {"q3_k", 4}, {"q2_k", 3}, {"q8_0", 2}, {"iq4_nl", 2}, {"iq4_xs", 3}, {"bf16", 1}, {"f16", 1}};
    TORCH_CHECK(qkv_bias.empty() || qkv_bias.size() == L, "one q/k/v bias (or None) per layer, or none at all");
    std::vector<BlockMatrix> matrices(4 * L);
    for (size_t i = 0; i < 4 * L; ++i) {
      TORCH_CHECK(!kinds[i].empty() && kinds[i].size() == arrays[i].size(), "matrix ", i, ": one kind per part");
      int64_t rows = 0;
      for (size_t j = 0; j < kinds[i].size(); ++j) {
        const auto it = arity.find(kinds[i][j]);
        TORCH_CHECK(it != arity.end(), "matrix ", i, ": unknown block layout ", kinds[i][j]);
        TORCH_CHECK(arrays[i][j].size() == it->second, "matrix ", i, ": ", kinds[i][j], " takes ", it->second, " arrays");
        BlockPart part{kinds[i][j], arrays[i][j]};
        part.outputs = part_outputs(part);
        rows += part.outputs;
        matrices[i].parts.push_back(std::move(part));
      }
      if (i % 4 == 0) TORCH_CHECK(qkv_bias.empty() || !qkv_bias[i / 4].has_value() || qkv_bias[i / 4]->size(0) == rows,
                                  "layer ", i / 4, "'s q/k/v bias must be float32 [", rows, "]");
    }
    auto matrix = [&](size_t i) { return matrices[i]; };
    for (size_t l = 0; l < L; ++l) {
      std::optional<torch::Tensor> bias = qkv_bias.empty() ? std::nullopt : qkv_bias[l];
      if (bias.has_value())
        TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->dim() == 1, "layer ", l, "'s q/k/v bias must be float32");
      layers_.push_back(Layer{norms[2 * l], norms[2 * l + 1], matrix(4 * l), matrix(4 * l + 1), matrix(4 * l + 2),
                              matrix(4 * l + 3), bias});
    }
  }

  // x [T, H] float32 (the embedded tokens) -> [T, H] after every layer. The attention arguments are
  // `paged_attention`'s (cpu_attention.py), for every layer's cache.
  torch::Tensor forward(torch::Tensor x, const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                        const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slots, int64_t num_rows,
                        const torch::Tensor& rows_start, const torch::Tensor& rows, const torch::Tensor& blocks_start,
                        const torch::Tensor& blocks, const torch::Tensor& tokens, int64_t bs, double scale,
                        int64_t chunk_tokens) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(), "one K and one V cache per layer");
    TORCH_CHECK(num_rows == x.size(0), "a decode stack's steps attend every row");
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      torch::Tensor qkv = L.qkv.run(x, RMSNORM, L.attn_norm, eps_, std::nullopt);
      if (L.qkv_bias.has_value()) qkv = qkv + *L.qkv_bias;  // as the loop's `y + bias`
      const torch::Tensor a = paged_attention(qkv, cos, sin, k_caches[i], v_caches[i], slots, num_heads_, num_rows,
                                              rows_start, rows, blocks_start, blocks, tokens, bs, scale, chunk_tokens);
      x = L.o.run(a, PLAIN, std::nullopt, 0.0, x);
      const torch::Tensor gate_up = L.gate_up.run(x, RMSNORM, L.mlp_norm, eps_, std::nullopt);
      x = L.down.run(gate_up, SWIGLU, std::nullopt, 0.0, x);
    }
    return x;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<Layer> layers_;
  double eps_;
  int64_t num_heads_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_enabled", &amx_on, "whether the stack's products of AMX_MIN_ROWS to AMX_MAX_ROWS rows run on the AMX tiles");
  m.def("set_amx", &set_amx, "turn the AMX tiles on (where supported) or off in this process");
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<const std::vector<torch::Tensor>&, const std::vector<std::vector<std::string>>&,
                    const std::vector<std::vector<std::vector<torch::Tensor>>>&, double, int64_t,
                    const std::vector<std::optional<torch::Tensor>>&>(),
           py::arg("norms"), py::arg("kinds"), py::arg("arrays"), py::arg("eps"), py::arg("num_heads"),
           py::arg("qkv_bias") = std::vector<std::optional<torch::Tensor>>())
      .def("forward", &DecodeStack::forward, "x [T, H] float32 through every layer of a decode step",
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_layers", &DecodeStack::num_layers);
}
