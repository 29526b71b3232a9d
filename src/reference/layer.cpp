// Public entry points of the reference layer: argument validation (every bad input becomes a
// mok::Error naming the argument), conversion between the public element types (bf16 bits or
// double) and the Real values of layer_core, and the recompute path of backward.
#include "reference/layer.hpp"

#include <span>
#include <string>

#include "common/routing_checks.hpp"
#include "mok/error.hpp"
#include "reference/layer_core.hpp"

namespace mok::ref {
namespace {

using detail::CoreInputs;
using detail::CoreWeights;

template <class Elem>
struct ElemTraits;
template <>
struct ElemTraits<uint16_t> {  // bf16 bits <-> fp32 values (exact both ways for bf16 values)
  using Real = float;
  static float load(uint16_t bits) { return from_bf16(bits); }
  static uint16_t store(float value) { return to_bf16(value); }
};
template <>
struct ElemTraits<double> {
  using Real = double;
  static double load(double v) { return v; }
  static double store(double v) { return v; }
};

template <class To, class From, class Fn>
std::vector<To> convert(const std::vector<From>& v, Fn fn) {
  std::vector<To> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = fn(v[i]);
  return out;
}

template <class To, class From, class Fn>
std::vector<std::vector<To>> convert_ranks(const std::vector<std::vector<From>>& v, Fn fn) {
  std::vector<std::vector<To>> out;
  out.reserve(v.size());
  for (const auto& r : v) out.push_back(convert<To>(r, fn));
  return out;
}

std::string rank_arg(const std::string& name, int rank) {
  return name + "[rank " + std::to_string(rank) + "]";
}

template <class T>
void check_size(const std::string& argument, const std::vector<T>& v, int64_t expected,
                const std::string& formula) {
  if (static_cast<int64_t>(v.size()) != expected) {
    throw_invalid(argument, formula + " = " + std::to_string(expected) + " elements",
                  std::to_string(v.size()));
  }
}

template <class T>
void check_rank_count(const std::string& argument, const std::vector<T>& v, int ep) {
  if (static_cast<int64_t>(v.size()) != ep) {
    throw_invalid(argument, "one vector per rank (ep = " + std::to_string(ep) + ")",
                  std::to_string(v.size()) + " vectors");
  }
}

template <class Elem>
void check_weights(const LayerShape& shape, const BasicLayerWeights<Elem>& w) {
  const int64_t E = shape.experts, H = shape.hidden, I = shape.intermediate;
  const int64_t Ish = shape.shared_intermediate;
  check_size("weights.gate", w.gate, E * I * H, "E*I*H");
  check_size("weights.up", w.up, E * I * H, "E*I*H");
  check_size("weights.down", w.down, E * H * I, "E*H*I");
  check_size("weights.shared_gate", w.shared_gate, Ish * H, "I_shared*H");
  check_size("weights.shared_up", w.shared_up, Ish * H, "I_shared*H");
  check_size("weights.shared_down", w.shared_down, H * Ish, "H*I_shared");
}

// Everything forward and backward check before touching data; returns the schedule.
template <class Elem, class Weight>
Schedule validate_call(const LayerShape& shape, const Config& config,
                       const BasicLayerWeights<Elem>& weights,
                       const BasicLayerInputs<Elem, Weight>& in,
                       const std::vector<std::vector<Elem>>* dy) {
  shape.validate();
  config.validate(shape);
  check_weights(shape, weights);
  const int ep = shape.ep;
  const int64_t T = shape.tokens, H = shape.hidden, K = shape.topk;
  check_rank_count("inputs.x", in.x, ep);
  check_rank_count("inputs.topk_idx", in.topk_idx, ep);
  check_rank_count("inputs.topk_w", in.topk_w, ep);
  // The token count of each rank, read off its x, must be the same T everywhere.
  std::vector<int64_t> tokens(ep);
  for (int r = 0; r < ep; ++r) {
    if (in.x[r].size() % H != 0) check_size(rank_arg("inputs.x", r), in.x[r], T * H, "T*H");
    tokens[r] = static_cast<int64_t>(in.x[r].size()) / H;
  }
  check_tokens_per_rank(shape, std::span<const int64_t>(tokens));
  for (int r = 0; r < ep; ++r) {
    check_size(rank_arg("inputs.x", r), in.x[r], T * H, "T*H");
    check_size(rank_arg("inputs.topk_idx", r), in.topk_idx[r], T * K, "T*K");
    check_size(rank_arg("inputs.topk_w", r), in.topk_w[r], T * K, "T*K");
    const std::vector<float> w32(in.topk_w[r].begin(), in.topk_w[r].end());
    check_topk_w(shape, r, std::span<const float>(w32));
  }
  if (dy != nullptr) {
    check_rank_count("dy", *dy, ep);
    for (int r = 0; r < ep; ++r) check_size(rank_arg("dy", r), (*dy)[r], T * H, "T*H");
  }
  return make_schedule(shape, config, in.topk_idx);  // checks topk_idx and the capacity
}

template <class Elem>
void check_saved(const LayerShape& shape, const BasicForwardContext<Elem>& saved,
                 const Schedule& schedule) {
  const int ep = shape.ep;
  check_rank_count("saved->ranks", saved.ranks, ep);
  bool same = saved.schedule.dest_row == schedule.dest_row &&
              saved.schedule.ranks.size() == schedule.ranks.size();
  for (size_t r = 0; same && r < schedule.ranks.size(); ++r) {
    same = saved.schedule.ranks[r].rows == schedule.ranks[r].rows &&
           saved.schedule.ranks[r].expert_offset == schedule.ranks[r].expert_offset;
  }
  if (!same) {
    throw_invalid("saved->schedule", "the schedule of inputs.topk_idx (the context of a "
                  "forward on the same routing)", "a different schedule");
  }
  const int64_t T = shape.tokens, I = shape.intermediate;
  const int64_t Ish = shape.shared_intermediate;
  for (int r = 0; r < ep; ++r) {
    const auto& c = saved.ranks[r];
    const int64_t rows = schedule.ranks[r].padded_rows;
    check_size(rank_arg("saved->g", r), c.g, rows * I, "padded_rows*I");
    check_size(rank_arg("saved->u", r), c.u, rows * I, "padded_rows*I");
    check_size(rank_arg("saved->shared_g", r), c.shared_g, T * Ish, "T*I_shared");
    check_size(rank_arg("saved->shared_u", r), c.shared_u, T * Ish, "T*I_shared");
  }
}

template <class Elem>
CoreWeights<typename ElemTraits<Elem>::Real> load_weights(const BasicLayerWeights<Elem>& w) {
  return {&w};
}

template <class Elem, class Weight>
CoreInputs<typename ElemTraits<Elem>::Real> load_inputs(const BasicLayerInputs<Elem, Weight>& in) {
  using Real = typename ElemTraits<Elem>::Real;
  CoreInputs<Real> out;
  out.x = convert_ranks<Real>(in.x, &ElemTraits<Elem>::load);
  out.topk_idx = &in.topk_idx;
  out.topk_w = convert_ranks<Real>(in.topk_w, [](Weight v) { return static_cast<Real>(v); });
  return out;
}

// Context element conversion, both directions (bf16 values are exact in fp32).
template <class To, class From, class Fn>
BasicForwardContext<To> convert_context(const BasicForwardContext<From>& c, Fn fn) {
  BasicForwardContext<To> out;
  out.schedule = c.schedule;
  for (const auto& r : c.ranks) {
    out.ranks.push_back({convert<To>(r.g, fn), convert<To>(r.u, fn), convert<To>(r.shared_g, fn),
                         convert<To>(r.shared_u, fn)});
  }
  return out;
}

template <class Elem, class Weight>
BasicForwardResult<Elem> forward_impl(const LayerShape& shape, const Config& config,
                                      const BasicLayerWeights<Elem>& weights,
                                      const BasicLayerInputs<Elem, Weight>& inputs, int threads,
                                      const Fp8Recipe* fp8 = nullptr) {
  using Real = typename ElemTraits<Elem>::Real;
  Schedule schedule = validate_call<Elem, Weight>(shape, config, weights, inputs, nullptr);
  CoreWeights<Real> w = load_weights(weights);
  w.fp8 = fp8;
  auto core = detail::forward_core<Real>(shape, w, load_inputs(inputs), std::move(schedule), threads);
  BasicForwardResult<Elem> result;
  result.y = convert_ranks<Elem>(core.y, &ElemTraits<Elem>::store);
  result.ctx = convert_context<Elem>(core.ctx, &ElemTraits<Elem>::store);
  return result;
}

template <class Elem, class Weight, class Acc>
BasicGradients<Elem, Acc> backward_impl(const LayerShape& shape, const Config& config,
                                        const BasicLayerWeights<Elem>& weights,
                                        const BasicLayerInputs<Elem, Weight>& inputs,
                                        const std::vector<std::vector<Elem>>& dy,
                                        const BasicForwardContext<Elem>* saved, int threads,
                                        const Fp8Recipe* fp8 = nullptr) {
  using Real = typename ElemTraits<Elem>::Real;
  Schedule schedule = validate_call(shape, config, weights, inputs, &dy);
  CoreWeights<Real> w = load_weights(weights);
  w.fp8 = fp8;
  const CoreInputs<Real> in = load_inputs(inputs);
  BasicForwardContext<Real> ctx;
  if (saved != nullptr) {
    check_saved(shape, *saved, schedule);
    ctx = convert_context<Real>(*saved, &ElemTraits<Elem>::load);
  } else {  // activation checkpointing: rebuild the context from the inputs
    ctx = std::move(detail::forward_core<Real>(shape, w, in, std::move(schedule), threads).ctx);
  }
  const auto core = detail::backward_core<Real>(
      shape, w, in, convert_ranks<Real>(dy, &ElemTraits<Elem>::load), ctx, threads);
  BasicGradients<Elem, Acc> g;
  g.dx = convert_ranks<Elem>(core.dx, &ElemTraits<Elem>::store);
  g.dtopk_w = core.dtopk_w;
  g.dgate = core.dgate;
  g.dup = core.dup;
  g.ddown = core.ddown;
  g.shared_dgate = core.shared_dgate;
  g.shared_dup = core.shared_dup;
  g.shared_ddown = core.shared_ddown;
  return g;
}

}  // namespace

ForwardResult forward(const LayerShape& shape, const Config& config, const LayerWeights& weights,
                      const LayerInputs& inputs, int threads) {
  return forward_impl(shape, config, weights, inputs, threads);
}

Gradients backward(const LayerShape& shape, const Config& config, const LayerWeights& weights,
                   const LayerInputs& inputs, const std::vector<std::vector<uint16_t>>& dy,
                   const ForwardContext* saved, int threads) {
  return backward_impl<uint16_t, float, float>(shape, config, weights, inputs, dy, saved, threads);
}

ForwardResult forward_fp8(const LayerShape& shape, const Config& config, const LayerWeights& weights,
                          const LayerInputs& inputs, const Fp8Recipe& recipe, int threads) {
  return forward_impl(shape, config, weights, inputs, threads, &recipe);
}

Gradients backward_fp8(const LayerShape& shape, const Config& config, const LayerWeights& weights,
                       const LayerInputs& inputs, const std::vector<std::vector<uint16_t>>& dy,
                       const ForwardContext* saved, const Fp8Recipe& recipe, int threads) {
  return backward_impl<uint16_t, float, float>(shape, config, weights, inputs, dy, saved, threads, &recipe);
}

ForwardResultF64 forward_f64(const LayerShape& shape, const Config& config,
                             const LayerWeightsF64& weights, const LayerInputsF64& inputs,
                             int threads) {
  return forward_impl(shape, config, weights, inputs, threads);
}

GradientsF64 backward_f64(const LayerShape& shape, const Config& config,
                          const LayerWeightsF64& weights, const LayerInputsF64& inputs,
                          const std::vector<std::vector<double>>& dy,
                          const ForwardContextF64* saved, int threads) {
  return backward_impl<double, double, double>(shape, config, weights, inputs, dy, saved, threads);
}

std::vector<uint16_t> dispatch_rows(const LayerShape& shape, const Schedule& schedule, int rank,
                                    const std::vector<std::vector<uint16_t>>& x) {
  if (rank < 0 || rank >= shape.ep || schedule.ranks.size() != static_cast<size_t>(shape.ep)) {
    throw_invalid("rank", "a rank in [0, ep = " + std::to_string(shape.ep) + ") of the schedule",
                  std::to_string(rank));
  }
  check_rank_count("x", x, shape.ep);
  for (int r = 0; r < shape.ep; ++r) {
    check_size(rank_arg("x", r), x[r], shape.tokens * shape.hidden, "T*H");
  }
  return detail::dispatch(shape, schedule.ranks[rank], x);
}

}  // namespace mok::ref
