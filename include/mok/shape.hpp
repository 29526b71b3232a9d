// LayerShape: the sizes of one MoE layer on one expert-parallel rank (docs/architecture.md).
#pragma once

#include <cstdint>
#include <string>

namespace mok {

// Multiples the GPU engine needs; the reference accepts the same shapes so that every
// shape the API accepts can be checked against it.
inline constexpr int64_t kHiddenMultiple = 64;        // H, I and shared I
inline constexpr int64_t kRowTile = 128;              // expert segments are padded to this many rows
inline constexpr int kMaxTopK = 32;
inline constexpr int kMaxEp = 64;

struct LayerShape {
  int64_t tokens = 0;               // T: tokens per rank (same on every rank)
  int64_t hidden = 0;               // H
  int64_t intermediate = 0;         // I: routed expert intermediate size
  int64_t shared_intermediate = 0;  // shared expert intermediate size; 0 = no shared expert
  int64_t experts = 0;              // E: routed experts in total over all ranks
  int topk = 0;                     // K: experts per token
  int ep = 1;                       // expert-parallel ranks

  int64_t local_experts() const { return experts / ep; }   // E_local
  int owner_rank(int64_t expert) const { return static_cast<int>(expert / local_experts()); }
  bool has_shared() const { return shared_intermediate > 0; }
  int64_t global_tokens() const { return tokens * ep; }
  // Useful FLOPs of one rank's forward: 2*3*H*I per routed row (T*K of them) plus 2*3*H*I_shared
  // per token for the shared expert (the backward does twice as many).
  double forward_flops() const {
    return 6.0 * double(hidden) * (double(intermediate) * double(tokens) * topk + double(shared_intermediate) * double(tokens));
  }

  // Throws mok::Error(kInvalidArgument) naming the first bad field.
  void validate() const;
  std::string to_string() const;
};

// The three model shapes the benchmarks use (DeepSeek-V3, Qwen3-30B-A3B, gpt-oss-120b; docs/architecture.md)
// at a given T per rank and EP size.
LayerShape dsv3_shape(int ep, int64_t tokens = 8192);
LayerShape qwen3_shape(int ep, int64_t tokens = 16384);
LayerShape gptoss_shape(int ep, int64_t tokens = 8192);

}  // namespace mok
