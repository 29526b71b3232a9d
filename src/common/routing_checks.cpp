#include "common/routing_checks.hpp"

#include <cmath>
#include <sstream>
#include <vector>

#include "mok/error.hpp"

namespace mok {
namespace {

std::string where(const char* name, int rank, int64_t token, int k) {
  std::ostringstream s;
  s << name << "[rank " << rank << ", token " << token << ", k " << k << "]";
  return s.str();
}

void check_size(const char* name, int rank, size_t got, int64_t expected) {
  if (static_cast<int64_t>(got) != expected) {
    throw_invalid(std::string(name) + "[rank " + std::to_string(rank) + "]",
                  "T*K = " + std::to_string(expected) + " entries", std::to_string(got));
  }
}

}  // namespace

void check_topk_idx(const LayerShape& shape, int rank, std::span<const int32_t> topk_idx) {
  check_size("topk_idx", rank, topk_idx.size(), shape.tokens * shape.topk);
  const int K = shape.topk;
  for (int64_t t = 0; t < shape.tokens; ++t) {
    const int32_t* row = topk_idx.data() + t * K;
    for (int k = 0; k < K; ++k) {
      if (row[k] < 0 || row[k] >= shape.experts) {
        throw_invalid(where("topk_idx", rank, t, k),
                      "an expert id in [0, " + std::to_string(shape.experts) + ")", std::to_string(row[k]));
      }
      for (int j = 0; j < k; ++j) {
        if (row[j] == row[k]) {
          throw_invalid(where("topk_idx", rank, t, k),
                        "distinct experts within one token (k " + std::to_string(j) + " already names expert " +
                            std::to_string(row[j]) + ")",
                        std::to_string(row[k]));
        }
      }
    }
  }
}

void check_topk_w(const LayerShape& shape, int rank, std::span<const float> topk_w) {
  check_size("topk_w", rank, topk_w.size(), shape.tokens * shape.topk);
  for (int64_t i = 0; i < static_cast<int64_t>(topk_w.size()); ++i) {
    if (!std::isfinite(topk_w[i])) {
      std::ostringstream got;
      got << topk_w[i];
      throw_invalid(where("topk_w", rank, i / shape.topk, static_cast<int>(i % shape.topk)),
                    "a finite router weight", got.str());
    }
  }
}

void check_tokens_per_rank(const LayerShape& shape, std::span<const int64_t> tokens_per_rank) {
  if (static_cast<int64_t>(tokens_per_rank.size()) != shape.ep) {
    throw_invalid("tokens per rank", std::to_string(shape.ep) + " ranks (LayerShape.ep)",
                  std::to_string(tokens_per_rank.size()));
  }
  for (size_t r = 0; r < tokens_per_rank.size(); ++r) {
    if (tokens_per_rank[r] != shape.tokens) {
      throw_invalid("tokens[rank " + std::to_string(r) + "]",
                    "the same T on every rank (LayerShape.tokens = " + std::to_string(shape.tokens) + ")",
                    std::to_string(tokens_per_rank[r]));
    }
  }
}

}  // namespace mok
