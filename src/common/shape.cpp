#include <limits>
#include <sstream>

#include "mok/error.hpp"
#include "mok/shape.hpp"

namespace mok {
namespace {

void check_multiple(const char* name, int64_t value, int64_t multiple, bool allow_zero) {
  if ((allow_zero ? value < 0 : value <= 0) || value % multiple != 0) {
    throw_invalid(std::string("LayerShape.") + name,
                  std::string(allow_zero ? "0 or a positive" : "a positive") + " multiple of " +
                      std::to_string(multiple),
                  std::to_string(value));
  }
}

}  // namespace

void LayerShape::validate() const {
  if (tokens < 1) throw_invalid("LayerShape.tokens", "at least 1 token per rank", std::to_string(tokens));
  check_multiple("hidden", hidden, kHiddenMultiple, false);
  check_multiple("intermediate", intermediate, kHiddenMultiple, false);
  check_multiple("shared_intermediate", shared_intermediate, kHiddenMultiple, true);
  if (ep < 1 || ep > kMaxEp) {
    throw_invalid("LayerShape.ep", "an EP size in [1, " + std::to_string(kMaxEp) + "]", std::to_string(ep));
  }
  if (experts < 1) throw_invalid("LayerShape.experts", "at least 1 expert", std::to_string(experts));
  if (experts % ep != 0) {
    throw_invalid("LayerShape.experts", "a multiple of ep = " + std::to_string(ep) +
                                            " (every rank holds E / ep experts)",
                  std::to_string(experts));
  }
  if (topk < 1 || topk > kMaxTopK || topk > experts) {
    throw_invalid("LayerShape.topk",
                  "K in [1, min(experts = " + std::to_string(experts) + ", " + std::to_string(kMaxTopK) + ")]",
                  std::to_string(topk));
  }
  // Row indices of the routing table are 32-bit on the device.
  const int64_t routed = tokens * topk * static_cast<int64_t>(ep);
  if (routed > std::numeric_limits<int32_t>::max() / 2) {
    throw_invalid("LayerShape.tokens", "tokens * topk * ep below 2^30 routed rows",
                  std::to_string(routed) + " routed rows");
  }
}

std::string LayerShape::to_string() const {
  std::ostringstream s;
  s << "T=" << tokens << " H=" << hidden << " I=" << intermediate << " I_shared=" << shared_intermediate
    << " E=" << experts << " K=" << topk << " ep=" << ep;
  return s.str();
}

LayerShape dsv3_shape(int ep, int64_t tokens) {
  return LayerShape{tokens, 7168, 2048, 2048, 256, 8, ep};
}
LayerShape qwen3_shape(int ep, int64_t tokens) {
  return LayerShape{tokens, 2048, 768, 0, 128, 8, ep};
}
LayerShape gptoss_shape(int ep, int64_t tokens) {
  return LayerShape{tokens, 2880, 2880, 0, 128, 4, ep};
}

}  // namespace mok
