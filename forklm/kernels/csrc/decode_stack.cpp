// A decode step's transformer layers in one C++ call, on forklm's CPU kernels: per layer the block
// kernel's q/k/v product (RMSNorm fused), the C++ attention (rotary, K/V write, attention), the o
// product (residual fused), the gate/up product (RMSNorm fused) and the down product (SwiGLU and
// residual fused): the same functions with the same arguments as the model's Python loop calls one
// by one (llama.py), so the result is the same bit for bit; what goes is ~150 calls a step from
// Python into C++ and the Python between them (~1 ms of a 7 ms step at one sample).
//
// The weights are handed over once (`DecodeStack`, built by kernels/decode_stack.py); a step passes
// the activations, the caches and the attention plan.

#define FORKLM_EMBEDDED 1  // the two kernels' sources below without their Python modules
#include "block_gemm.cpp"
#include "paged_attention.cpp"

namespace {

struct BlockMatrix {
  torch::Tensor qs, d, m;  // m: Q4_1 minima, undefined for Q8_0
  bool q41;

  torch::Tensor run(const torch::Tensor& x, Prologue mode, const std::optional<torch::Tensor>& norm, double eps,
                    const std::optional<torch::Tensor>& residual) const {
    return q41 ? gemm<true>(x, qs, d, m, mode, norm, eps, residual) : gemm<false>(x, qs, d, d, mode, norm, eps, residual);
  }
};

struct Layer {
  torch::Tensor attn_norm, mlp_norm;
  BlockMatrix qkv, o, gate_up, down;
  std::optional<torch::Tensor> qkv_bias;  // [(h + 2g)·D] float32 (Qwen2), added after the product
};

class DecodeStack {
 public:
  // norms [2L]: attn_norm, mlp_norm per layer; qs / d / m / q41 [4L]: qkv, o, gate_up, down per layer
  DecodeStack(const std::vector<torch::Tensor>& norms, const std::vector<torch::Tensor>& qs,
              const std::vector<torch::Tensor>& d, const std::vector<std::optional<torch::Tensor>>& m,
              const std::vector<bool>& q41, double eps, int64_t num_heads,
              const std::vector<std::optional<torch::Tensor>>& qkv_bias)
      : eps_(eps), num_heads_(num_heads) {
    const size_t L = norms.size() / 2;
    TORCH_CHECK(norms.size() == 2 * L && qs.size() == 4 * L && d.size() == 4 * L && m.size() == 4 * L && q41.size() == 4 * L,
                "a decode stack needs 2 norms and 4 block matrices per layer");
    for (size_t i = 0; i < 4 * L; ++i)
      TORCH_CHECK(q41[i] == m[i].has_value(), "Q4_1 matrices carry minima, Q8_0 ones none (matrix ", i, ")");
    auto matrix = [&](size_t i) { return BlockMatrix{qs[i], d[i], m[i].has_value() ? *m[i] : torch::Tensor(), q41[i]}; };
    TORCH_CHECK(qkv_bias.empty() || qkv_bias.size() == L, "one q/k/v bias (or None) per layer, or none at all");
    for (size_t l = 0; l < L; ++l) {
      std::optional<torch::Tensor> bias = qkv_bias.empty() ? std::nullopt : qkv_bias[l];
      if (bias.has_value())
        TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->dim() == 1 && bias->size(0) == qs[4 * l].size(0),
                    "layer ", l, "'s q/k/v bias must be float32 [", qs[4 * l].size(0), "]");
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
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<const std::vector<torch::Tensor>&, const std::vector<torch::Tensor>&, const std::vector<torch::Tensor>&,
                    const std::vector<std::optional<torch::Tensor>>&, const std::vector<bool>&, double, int64_t,
                    const std::vector<std::optional<torch::Tensor>>&>(),
           py::arg("norms"), py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("q41"), py::arg("eps"),
           py::arg("num_heads"), py::arg("qkv_bias") = std::vector<std::optional<torch::Tensor>>())
      .def("forward", &DecodeStack::forward, "x [T, H] float32 through every layer of a decode step")
      .def_property_readonly("num_layers", &DecodeStack::num_layers);
}
