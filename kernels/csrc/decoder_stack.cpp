// The decoder layers of a Llama-family model in one native call: the CPU engine's
// counterpart of a captured decode graph (kernels/cpu_ops.py `decoder_stack`).
//
// Why: at batch 1 a CPU step spends about a fifth of its time in Python between the
// operators (module calls, attribute lookups, views, splits), some 100 us per layer.
// This loop calls the same operators in the same order from C++, so its output is the
// Python path's bit for bit and the step pays one Python call for all layers.
//
// It holds no kernels of its own: the projections go to oneDNN's prepacked linear,
// at::linear, the int8 products of kernels/int8_matmul.py or the int4 ones of
// kernels/int4_matmul.py; everything else to the
// loraplex_cpu ops of cpu_ops.cpp, reached through the dispatcher by typed handles
// looked up once.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string_view>

namespace {

using at::Tensor;

using RmsNormFn = void(const Tensor&, const std::optional<Tensor>&, const Tensor&, double, Tensor,
                       std::optional<Tensor>);
using SiluAndMulFn = Tensor(const Tensor&);
using RotaryWriteKvFn = void(Tensor, Tensor, const Tensor&, const Tensor&, const Tensor&, Tensor,
                             const Tensor&);
using AttentionFn = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                         Tensor);
using PrefillAttentionFn = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, double, Tensor);
using LoraAddFn = void(Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       const Tensor&, at::IntArrayRef);
using QuantizeRowsFn = void(const Tensor&, const std::optional<Tensor>&, Tensor&, Tensor&);
using Int8RowsFn = void(const Tensor&, const std::optional<Tensor>&, const Tensor&, const Tensor&,
                        const Tensor&, const std::optional<Tensor>&, Tensor);
using DequantizeFn = void(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&,
                          Tensor&);
using DequantizeInt4Fn = void(const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t,
                               Tensor);
using PackedLinearFn = Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                              std::string_view, c10::List<std::optional<at::Scalar>>,
                              std::optional<std::string_view>);

template <typename Fn>
c10::TypedOperatorHandle<Fn> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// The operators a layer calls, looked up on first use (both libraries are registered
// by then: this one is loaded with cpu_ops.cpp, and mkldnn's with torch).
struct Ops {
  c10::TypedOperatorHandle<RmsNormFn> rms_norm = typed_op<RmsNormFn>("loraplex_cpu::rms_norm");
  c10::TypedOperatorHandle<SiluAndMulFn> silu_and_mul =
      typed_op<SiluAndMulFn>("loraplex_cpu::silu_and_mul");
  c10::TypedOperatorHandle<RotaryWriteKvFn> rotary_write_kv =
      typed_op<RotaryWriteKvFn>("loraplex_cpu::rotary_write_kv");
  c10::TypedOperatorHandle<AttentionFn> attention =
      typed_op<AttentionFn>("loraplex_cpu::paged_decode_attention");
  c10::TypedOperatorHandle<PrefillAttentionFn> prefill_attention =
      typed_op<PrefillAttentionFn>("loraplex_cpu::paged_prefill_attention");
  c10::TypedOperatorHandle<LoraAddFn> lora_add = typed_op<LoraAddFn>("loraplex_cpu::lora_add");
  c10::TypedOperatorHandle<QuantizeRowsFn> quantize_rows =
      typed_op<QuantizeRowsFn>("loraplex_cpu::quantize_rows_int8");
  c10::TypedOperatorHandle<Int8RowsFn> int8_rows =
      typed_op<Int8RowsFn>("loraplex_cpu::int8_linear_rows");
  c10::TypedOperatorHandle<DequantizeFn> dequantize =
      typed_op<DequantizeFn>("loraplex_cpu::dequantize_int32");
  c10::TypedOperatorHandle<DequantizeInt4Fn> dequantize_int4 =
      typed_op<DequantizeInt4Fn>("loraplex_cpu::dequantize_int4");
  c10::TypedOperatorHandle<PackedLinearFn> packed_linear =
      typed_op<PackedLinearFn>("mkldnn::_linear_pointwise");

  static const Ops& get() {
    static const Ops ops;
    return ops;
  }
};

// One step's inputs that every layer reads.
struct StepInputs {
  const Tensor& cos;
  const Tensor& sin;
  const Tensor& slot_mapping;
  int64_t num_decodes;
  const Tensor& decode_tables;
  const Tensor& decode_lens;
  const Tensor& prefill_tables;
  const Tensor& prefill_query_lens;
  const Tensor& prefill_seq_lens;
  const Tensor& token_slots;  // empty: no adapter in this step
  const Tensor& slot_ranks;
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;
};

// The model's projections in the order of `weights`: per layer qkv, o, gate_up, down.
constexpr int64_t kProjections = 4;

// How the projections multiply (kernels/cpu_matmul.py, kernels/int8_matmul.py,
// kernels/int4_matmul.py).
enum class Projection { kPacked, kPlain, kInt8Dynamic, kInt8WeightOnly, kInt4 };

// Tensors per projection in `weights`: W; or for int8, q [out, in] (weight-only; else
// empty), q.T [in, out] (dynamic; else empty), scale [out] fp32, scale [out] bf16, the
// VNNI packing and column sums of q (dynamic on a CPU with VNNI; else empty), and the
// activations' per-channel input scales [in] (dynamic with smoothing; else empty).
constexpr int64_t kInt8Tensors = 7;

// Tensors per projection for int4: torch's int4 packing and its scales and zeros (where
// torch's kernel takes the group size; else empty), the int4 values packed eight to an
// int32 [out, in / 8], scales [out, groups] fp32, zero points [out, groups] int8 (else
// empty), and int64 [out, in, group size, torch's group size, torch's padded in].
constexpr int64_t kInt4Tensors = 6;

int64_t tensors_per_projection(Projection kind) {
  switch (kind) {
    case Projection::kInt8Dynamic:
    case Projection::kInt8WeightOnly:
      return kInt8Tensors;
    case Projection::kInt4:
      return kInt4Tensors;
    default:
      return 1;
  }
}

Projection parse_projection(std::string_view name) {
  if (name == "packed") return Projection::kPacked;
  if (name == "plain") return Projection::kPlain;
  if (name == "int8_dynamic") return Projection::kInt8Dynamic;
  if (name == "int4") return Projection::kInt4;
  TORCH_CHECK(name == "int8_weight_only", "unknown projection kind ", name);
  return Projection::kInt8WeightOnly;
}

class Stack {
 public:
  Stack(const Ops& ops, const StepInputs& in, at::TensorList weights,
        const c10::List<std::optional<Tensor>>& biases, Projection kind,
        int64_t row_bound, at::TensorList lora_a, at::TensorList lora_b,
        at::IntArrayRef lora_slices, at::IntArrayRef lora_slice_ends)
      : ops_(ops), in_(in), weights_(weights), biases_(biases), kind_(kind),
        row_bound_(row_bound), lora_a_(lora_a), lora_b_(lora_b) {
    size_t offset = 0;
    for (int64_t kind_index = 0; kind_index < static_cast<int64_t>(lora_slices.size());
         ++kind_index) {
      const auto count = static_cast<size_t>(lora_slices[kind_index]);
      lora_slice_ends_[kind_index] = lora_slice_ends.slice(offset, count);
      offset += count;
    }
  }

  // x [T, in] -> x @ W.T + b [T, out] for projection `index` (layer * 4 + kind).
  Tensor linear(int64_t index, const Tensor& x) const {
    const std::optional<Tensor> bias = biases_.get(index);
    switch (kind_) {
      case Projection::kPacked:
        return ops_.packed_linear.call(x.contiguous(), weights_[index], bias, "none",
                                       c10::List<std::optional<at::Scalar>>(),
                                       std::string_view(""));
      case Projection::kPlain:
        return at::linear(x, weights_[index], bias);
      case Projection::kInt4:
        return int4_linear(&weights_[index * kInt4Tensors], x, bias);
      default:
        return int8_linear(&weights_[index * kInt8Tensors], x, bias);
    }
  }

  // Int4Weight.__call__: torch's int4 kernel up to `row_bound` rows where it takes the
  // group size (inputs padded to its groups, output channels cut back from 16s), else
  // the weight dequantized to x's dtype and a float matmul.
  Tensor int4_linear(const Tensor* w, const Tensor& x, const std::optional<Tensor>& bias) const {
    const int64_t* meta = w[5].data_ptr<int64_t>();
    const int64_t out_features = meta[0], in_features = meta[1], group_size = meta[2];
    if (w[0].numel() > 0 && x.size(0) <= row_bound_) {
      const int64_t padding = meta[4] - in_features;
      const Tensor padded =
          (padding > 0 ? at::constant_pad_nd(x, {0, padding}) : x).contiguous();
      Tensor out = at::_weight_int4pack_mm_for_cpu(padded, w[0], meta[3], w[1]);
      if (out.size(1) != out_features) {
        out = out.narrow(1, 0, out_features).contiguous();
      }
      if (bias.has_value()) {
        out += *bias;
      }
      return out;
    }
    Tensor weight = at::empty({out_features, in_features}, x.options());
    const std::optional<Tensor> zeros = w[4].numel() > 0 ? std::optional<Tensor>(w[4]) : std::nullopt;
    ops_.dequantize_int4.call(w[2], w[3], zeros, group_size, weight);
    return at::linear(x, weight, bias);
  }

  // Int8Weight.__call__ with the native ops: W8A8 at every batch (the VNNI kernel where
  // packed, else torch's int8 matmul, rows padded up past `row_bound`), or the
  // weight-only product with bf16 activations.
  Tensor int8_linear(const Tensor* w, const Tensor& x, const std::optional<Tensor>& bias) const {
    if (kind_ == Projection::kInt8Dynamic) {
      const Tensor xc = x.contiguous();
      const int64_t rows = xc.size(0);
      const std::optional<Tensor> input_scales =
          w[6].numel() > 0 ? std::optional<Tensor>(w[6]) : std::nullopt;
      if (w[4].numel() > 0) {
        Tensor out = at::empty({rows, w[2].size(0)}, x.options());
        ops_.int8_rows.call(xc, input_scales, w[4], w[5], w[2], bias, out);
        return out;
      }
      Tensor quantized = at::empty(xc.sizes(), xc.options().dtype(at::kChar));
      Tensor row_scales = at::empty({rows, 1}, xc.options().dtype(at::kFloat));
      ops_.quantize_rows.call(xc, input_scales, quantized, row_scales);
      const int64_t padding = std::max<int64_t>(0, row_bound_ + 1 - rows);
      const Tensor padded =
          padding > 0 ? at::constant_pad_nd(quantized, {0, 0, 0, padding}) : quantized;
      const Tensor acc = at::_int_mm(padded, w[1]).narrow(0, 0, rows).contiguous();
      Tensor out = at::empty(acc.sizes(), x.options());
      ops_.dequantize.call(acc, row_scales, w[2], bias, out);
      return out;
    }
    Tensor out = at::_weight_int8pack_mm(x.to(at::kBFloat16).contiguous(), w[0], w[3]);
    out = out.to(x.scalar_type());
    if (bias.has_value()) {
      out += *bias;
    }
    return out;
  }

  // x [T, in] -> [T, out]: projection `index` with its LoRA deltas.
  Tensor project(int64_t index, const Tensor& x) const {
    Tensor out = linear(index, x);
    if (in_.token_slots.defined() && in_.token_slots.numel() > 0 && !lora_a_.empty()) {
      ops_.lora_add.call(out, x, lora_a_[index], lora_b_[index], in_.token_slots, in_.slot_ranks,
                         lora_slice_ends_[index % kProjections]);
    }
    return out;
  }

  // (normed, new residual): `residual` undefined on the first layer, whose residual
  // stream is its input.
  std::pair<Tensor, Tensor> norm(const Tensor& x, const Tensor& residual,
                                 const Tensor& weight) const {
    Tensor out = at::empty_like(x);
    if (!residual.defined()) {
      ops_.rms_norm.call(x, std::nullopt, weight, in_.eps, out, std::nullopt);
      return {out, x};
    }
    Tensor residual_out = at::empty_like(x);
    ops_.rms_norm.call(x, residual, weight, in_.eps, out, residual_out);
    return {out, residual_out};
  }

  // normed [T, hidden] -> attention output projected by o: [T, hidden].
  Tensor attention(int64_t layer, const Tensor& normed, const Tensor& kv_cache) const {
    const int64_t tokens = normed.size(0);
    const int64_t q_size = in_.num_heads * in_.head_dim;
    const int64_t kv_size = in_.num_kv_heads * in_.head_dim;
    const Tensor qkv = project(layer * kProjections, normed);
    Tensor q = qkv.narrow(1, 0, q_size).view({tokens, in_.num_heads, in_.head_dim});
    Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, in_.num_kv_heads, in_.head_dim});
    Tensor v =
        qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, in_.num_kv_heads, in_.head_dim});
    ops_.rotary_write_kv.call(q, k, v, in_.cos, in_.sin, kv_cache, in_.slot_mapping);
    Tensor out = at::empty(q.sizes(), q.options());
    const int64_t decodes = in_.num_decodes;
    if (decodes > 0) {
      ops_.attention.call(q.narrow(0, 0, decodes), kv_cache, in_.decode_tables, in_.decode_lens,
                          in_.scale, out.narrow(0, 0, decodes));
    }
    if (tokens > decodes) {
      ops_.prefill_attention.call(q.narrow(0, decodes, tokens - decodes), kv_cache,
                                  in_.prefill_tables, in_.prefill_query_lens,
                                  in_.prefill_seq_lens, in_.scale,
                                  out.narrow(0, decodes, tokens - decodes));
    }
    return project(layer * kProjections + 1, out.view({tokens, q_size}));
  }

  // normed [T, hidden] -> down(silu(gate) * up): [T, hidden].
  Tensor mlp(int64_t layer, const Tensor& normed) const {
    const Tensor gate_up = project(layer * kProjections + 2, normed);
    return project(layer * kProjections + 3, ops_.silu_and_mul.call(gate_up));
  }

 private:
  const Ops& ops_;
  const StepInputs& in_;
  at::TensorList weights_;
  const c10::List<std::optional<Tensor>>& biases_;
  Projection kind_;
  int64_t row_bound_;
  at::TensorList lora_a_, lora_b_;
  std::array<at::IntArrayRef, kProjections> lora_slice_ends_;
};

// Semantics: equal (bit for bit) to LlamaForCausalLM's layer loop and final norm on the
// 'cpu' kernel backend, one rank:
//   residual = hidden
//   per layer l:  normed, residual = rms_norm(hidden, residual, norm_weights[2l])
//                 q, k, v = split(proj(4l, normed)); rotate q, k; write k, v to the cache
//                 attn = paged attention of the decodes (decode_tables / decode_lens)
//                        and of the prefill chunks (prefill_tables, prefill_query_lens,
//                        prefill_seq_lens: paged_prefill_attention)
//                 hidden = proj(4l + 1, attn)
//                 normed, residual = rms_norm(hidden, residual, norm_weights[2l + 1])
//                 hidden = proj(4l + 3, silu_and_mul(proj(4l + 2, normed)))
//   returns rms_norm(hidden, residual, norm_weights[2L])[0]   [T, hidden]
// where proj(i, x) = x @ W_i.T + b_i (+ each token's LoRA delta: lora_add with
// lora_a[i], lora_b[i] and kind i % 4's slice ends when token_slots is not empty), multiplied as
// `projection` says: "packed" (weights [4L] prepacked by oneDNN), "plain" ([4L] of
// [out, in]), "int8_dynamic" / "int8_weight_only" (weights [28L]: per projection the
// seven tensors of kInt8Tensors; the dynamic product runs the VNNI kernel where packed,
// else pads to more than `row_bound` rows, as kernels/int8_matmul.py) or "int4"
// ([24L]: per projection the six tensors of kInt4Tensors; torch's int4 kernel up to
// `row_bound` rows, as kernels/int4_matmul.py).
// hidden [T, hidden] (the embedded tokens); cos / sin [T, Dh/2]; norm_weights [2L + 1];
// biases [4L] (None: no bias); kv_caches [L] of [2, N, Hkv, B, Dh]; slot_mapping [T] int64; the first
// num_decodes tokens are decodes, each with its block table row and key count ([D, W],
// [D] int64), the rest prefill chunks, each with its block table row, query length and
// sequence length ([P, W], [P], [P] int64); lora_a / lora_b [4L], lora_slices [4] (each
// projection kind's slice count) and lora_slice_ends (the kinds' slice ends, in turn:
// lora_add's slice_ends), or all empty; token_slots [T] int64 or empty; slot_ranks [max_loras] int64 or empty;
// head_shape = (heads, kv heads, head dim).
Tensor decoder_stack(const Tensor& hidden, const Tensor& cos, const Tensor& sin,
                     at::TensorList norm_weights, at::TensorList weights,
                     const c10::List<std::optional<Tensor>>& biases,
                     std::string_view projection, int64_t row_bound,
                     at::TensorList kv_caches, const Tensor& slot_mapping, int64_t num_decodes,
                     const Tensor& decode_tables, const Tensor& decode_lens,
                     const Tensor& prefill_tables, const Tensor& prefill_query_lens,
                     const Tensor& prefill_seq_lens,
                     at::TensorList lora_a, at::TensorList lora_b, at::IntArrayRef lora_slices,
                     at::IntArrayRef lora_slice_ends, const Tensor& token_slots, const Tensor& slot_ranks,
                     at::IntArrayRef head_shape, double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be contiguous [T, hidden]");
  TORCH_CHECK(static_cast<int64_t>(norm_weights.size()) == 2 * layers + 1,
              "norm_weights: two per layer and the final norm");
  const Projection kind = parse_projection(projection);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) ==
                      kProjections * layers * tensors_per_projection(kind) &&
                  static_cast<int64_t>(biases.size()) == kProjections * layers,
              "weights / biases: four projections per layer");
  TORCH_CHECK(lora_a.size() == lora_b.size(), "lora_a / lora_b: as many of each");
  TORCH_CHECK(lora_a.empty() || static_cast<int64_t>(lora_a.size()) == kProjections * layers,
              "lora_a / lora_b: one per projection");
  TORCH_CHECK(lora_a.empty() || lora_slices.size() == kProjections,
              "lora_slices: one per projection kind");
  int64_t slice_count = 0;
  for (const int64_t count : lora_slices) {
    TORCH_CHECK(count >= 1, "lora_slices: at least one slice per projection kind");
    slice_count += count;
  }
  TORCH_CHECK(lora_a.empty() || static_cast<int64_t>(lora_slice_ends.size()) == slice_count,
              "lora_slice_ends: each kind's slice ends, as many as lora_slices says");
  TORCH_CHECK(head_shape.size() == 3, "head_shape = (heads, kv heads, head dim)");
  TORCH_CHECK(num_decodes >= 0 && num_decodes <= hidden.size(0), "num_decodes out of range");
  TORCH_CHECK(!token_slots.defined() || token_slots.numel() == 0 ||
                  token_slots.numel() == hidden.size(0),
              "token_slots: none, or one per token");
  const StepInputs in{cos,
                      sin,
                      slot_mapping,
                      num_decodes,
                      decode_tables,
                      decode_lens,
                      prefill_tables,
                      prefill_query_lens,
                      prefill_seq_lens,
                      token_slots,
                      slot_ranks,
                      head_shape[0],
                      head_shape[1],
                      head_shape[2],
                      eps,
                      scale};
  const Ops& ops = Ops::get();
  const Stack stack(ops, in, weights, biases, kind, row_bound, lora_a, lora_b,
                    lora_slices, lora_slice_ends);
  Tensor x = hidden;
  Tensor residual;
  for (int64_t layer = 0; layer < layers; ++layer) {
    auto [normed, res] = stack.norm(x, residual, norm_weights[2 * layer]);
    const Tensor attended = stack.attention(layer, normed, kv_caches[layer]);
    auto [post, res2] = stack.norm(attended, res, norm_weights[2 * layer + 1]);
    x = stack.mlp(layer, post);
    residual = res2;
  }
  return stack.norm(x, residual, norm_weights[2 * layers]).first;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loraplex_cpu, m) {
  m.def("decoder_stack(Tensor hidden, Tensor cos, Tensor sin, Tensor[] norm_weights, "
        "Tensor[] weights, Tensor?[] biases, str projection, int row_bound, "
        "Tensor(a!)[] kv_caches, "
        "Tensor slot_mapping, int num_decodes, Tensor decode_tables, Tensor decode_lens, "
        "Tensor prefill_tables, Tensor prefill_query_lens, Tensor prefill_seq_lens, "
        "Tensor[] lora_a, Tensor[] lora_b, "
        "int[] lora_slices, int[] lora_slice_ends, Tensor token_slots, Tensor slot_ranks, int[] head_shape, "
        "float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(loraplex_cpu, CPU, m) {
  m.impl("decoder_stack", &decoder_stack);
}

// oneDNN's prepacked weights are MkldnnCPU tensors, and the dispatcher routes a call
// by its arguments' highest key: the same kernel serves both.
TORCH_LIBRARY_IMPL(loraplex_cpu, MkldnnCPU, m) {
  m.impl("decoder_stack", &decoder_stack);
}
