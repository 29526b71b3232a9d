#include <algorithm>
#include <cmath>
#include <sstream>

#include "mok/config.hpp"
#include "mok/error.hpp"

namespace mok {
namespace {

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

void check_comm_sms(const char* name, int value, bool allow_auto) {
  if (value < (allow_auto ? 0 : 1) || value > 128) {
    throw_invalid(std::string("Config.") + name,
                  std::string(allow_auto ? "0 (automatic) or " : "") + "a number of communication SMs in [1, 128]",
                  std::to_string(value));
  }
}

// An automatic count of communication SMs that a set grid cannot hold shrinks to fit it,
// leaving at least one GEMM SM (any count gives the same bits).
int fit_grid(int automatic, int grid_sms) {
  return grid_sms > 0 ? std::clamp(automatic, 1, std::max(grid_sms - 1, 1)) : automatic;
}

}  // namespace

void Config::validate(const LayerShape& shape) const {
  shape.validate();
  check_comm_sms("comm_sms_forward", comm_sms_forward, true);
  check_comm_sms("comm_sms_backward", comm_sms_backward, true);
  if (grid_sms < 0 || grid_sms == 1 || grid_sms > 1024) {
    throw_invalid("Config.grid_sms",
                  "0 (every SM) or a number of SMs in [2, 1024] (at least one communication and one GEMM SM)",
                  std::to_string(grid_sms));
  }
  // An explicit count must leave GEMM SMs in a set grid (an automatic one is fitted to it).
  for (const auto& [name, value] : {std::pair{"Config.comm_sms_forward", comm_sms_forward},
                                    std::pair{"Config.comm_sms_backward", comm_sms_backward}}) {
    if (grid_sms != 0 && value >= grid_sms) {
      throw_invalid(name,
                    "0 (automatic) or fewer than Config.grid_sms = " + std::to_string(grid_sms) +
                        " so that GEMM SMs remain",
                    std::to_string(value));
    }
  }
  if (minibatch < 0 || minibatch % kRowTile != 0) {
    throw_invalid("Config.minibatch", "0 (automatic) or a positive multiple of " + std::to_string(kRowTile) + " rows",
                  std::to_string(minibatch));
  }
  const int64_t mb = effective_minibatch(shape);
  if (macrobatch < 0 || macrobatch % mb != 0) {
    throw_invalid("Config.macrobatch",
                  "0 (keep every routed row) or a positive multiple of the minibatch (" + std::to_string(mb) + " rows)",
                  std::to_string(macrobatch));
  }
  // A ring of one minibatch would make GEMM 1 of minibatch m wait for GEMM 2 of m - 1, which
  // the task list hands out after it (task_list.cuh): the kernel could deadlock.
  if (macrobatch > 0 && macrobatch < buffer_rows_per_rank(shape) && macrobatch < 2 * mb) {
    throw_invalid("Config.macrobatch",
                  "0 (keep every routed row), at least two minibatches (" + std::to_string(2 * mb) +
                      " rows) or at least the routed buffer (" + std::to_string(buffer_rows_per_rank(shape)) + " rows)",
                  std::to_string(macrobatch));
  }
  if (!std::isfinite(capacity) || capacity < 1.0) {
    std::ostringstream got;
    got << capacity;
    throw_invalid("Config.capacity",
                  "a finite multiple >= 1.0 of the balanced share T*K of routed rows per rank", got.str());
  }
  if (!std::isfinite(wait_timeout_s) || wait_timeout_s <= 0.0 || wait_timeout_s > 3600.0) {
    std::ostringstream got;
    got << wait_timeout_s;
    throw_invalid("Config.wait_timeout_s", "seconds in (0, 3600]", got.str());
  }
  const auto fe = static_cast<int32_t>(forward_engine);
  if (fe < 0 || fe > 1) throw_invalid("Config.forward_engine", "0 (fused) or 1 (staged)", std::to_string(fe));
  const auto be = static_cast<int32_t>(backward_engine);
  if (be < 0 || be > 2) {
    throw_invalid("Config.backward_engine", "0 (auto), 1 (fused) or 2 (staged)", std::to_string(be));
  }
  const auto pr = static_cast<int32_t>(precision);
  if (pr < 0 || pr > 1) throw_invalid("Config.precision", "0 (bf16) or 1 (fp8_block)", std::to_string(pr));
  // The FP8 passes are the staged engine's launches (docs/fp8.md "The FP8 layer"): every routed row
  // stays resident, so no macrobatch ring.
  if (precision == Precision::kFp8Block && resident_routed_rows(shape) < buffer_rows_per_rank(shape)) {
    throw_invalid("Config.macrobatch",
                  "0 or at least the routed buffer (" + std::to_string(buffer_rows_per_rank(shape)) +
                      " rows) with Config.precision = fp8_block (the FP8 passes keep every routed row)",
                  std::to_string(macrobatch));
  }
}

const char* to_string(Precision precision) {
  switch (precision) {
    case Precision::kBf16: return "bf16";
    case Precision::kFp8Block: return "fp8_block";
  }
  return "invalid";
}

const char* to_string(ForwardEngine engine) {
  switch (engine) {
    case ForwardEngine::kFused: return "fused";
    case ForwardEngine::kStaged: return "staged";
  }
  return "invalid";
}

const char* to_string(BackwardEngine engine) {
  switch (engine) {
    case BackwardEngine::kAuto: return "auto";
    case BackwardEngine::kFused: return "fused";
    case BackwardEngine::kStaged: return "staged";
  }
  return "invalid";
}

// The one line that picks the backward engine per gradient mode. One interleaved run (1x H200,
// 2026-12-06, docs/megakernel.md "Choosing the backward engine"): fused / staged = 0.89-0.99 with
// fp32 main grads, 0.963-1.008 with bf16 gradients (dsv3, gptoss faster, qwen3 0.8 % slower), so
// the fused engine in both modes (the argument stays for rules that differ by mode).
BackwardEngine auto_backward_engine(bool /*fp32_main_grads*/) { return BackwardEngine::kFused; }

BackwardEngine Config::effective_backward_engine(bool fp32_main_grads) const {
  return backward_engine == BackwardEngine::kAuto ? auto_backward_engine(fp32_main_grads) : backward_engine;
}

int64_t Config::max_rows_per_rank(const LayerShape& shape) const {
  const double share = std::min(capacity, static_cast<double>(shape.ep));
  const int64_t balanced = shape.tokens * shape.topk;
  const int64_t rows = static_cast<int64_t>(std::ceil(share * static_cast<double>(balanced)));
  return std::min(rows, balanced * shape.ep);
}

int64_t Config::buffer_rows_per_rank(const LayerShape& shape) const {
  return round_up(max_rows_per_rank(shape) + shape.local_experts() * (kRowTile - 1), kRowTile);
}

int64_t Config::effective_minibatch(const LayerShape& shape) const {
  if (minibatch > 0) return minibatch;
  // About eight overlap steps per pass, between one and 32 row tiles each.
  const int64_t rows = round_up(std::max<int64_t>(shape.tokens * shape.topk / 8, 1), kRowTile);
  return std::clamp<int64_t>(rows, kRowTile, 32 * kRowTile);
}

int64_t Config::resident_routed_rows(const LayerShape& shape) const {
  const int64_t all = buffer_rows_per_rank(shape);
  return macrobatch > 0 && macrobatch < all ? macrobatch : all;
}

int Config::effective_comm_sms_forward(const LayerShape& shape) const {
  if (comm_sms_forward > 0) return comm_sms_forward;
  // Dispatch and combine each handle every routed row (T*K rows of H bf16); with the dedup
  // fan-out dispatch and the in-place combine one comm CTA gets through about 33 GB/s of those
  // rows, the GEMM SMs deliver about 600 TFLOP/s (H200, docs/perf-log.md). Pick the CTAs that
  // finish the rows in the GEMMs' time, at least 6: this lands on the best points of the
  // 2026-11-30 sweeps after the fan-out (forward-v6..v8: dsv3 4-8, qwen3 16, gptoss 6-8).
  // Any count gives the same bits (D2).
  const double rows = static_cast<double>(shape.tokens) * shape.topk;
  const double bytes = 2.0 * rows * static_cast<double>(shape.hidden) * 2.0;
  const double flops = 6.0 * static_cast<double>(shape.hidden) *
                       (static_cast<double>(shape.intermediate) * rows +
                        static_cast<double>(shape.shared_intermediate) * static_cast<double>(shape.tokens));
  const double gemm_s = flops / 600e12, cta_bytes_per_s = 33e9;
  int ctas = static_cast<int>(std::ceil(bytes / (gemm_s * cta_bytes_per_s)));
  // With the macrobatch ring the comm CTAs dispatch for the whole pass (each tile waits for its
  // slot) and never get to join: the bytes-per-flop count above, as at EP >= 2 (dsv3 at EP 1: a
  // ring of 16384 rows cost +2.8 % at 4 comm CTAs, +7.7 % at 16, docs/megakernel.md).
  const bool ring = resident_routed_rows(shape) < buffer_rows_per_rank(shape);
  if (shape.ep == 1 && !ring) {
    // EP 1: no combine, and every comm CTA takes GEMM tasks once its dispatch share (a local
    // copy of the T*K rows) is done, so more CTAs cost little and bring the rows sooner: at
    // least one per 60 MB of rows, up to 16. Moves dsv3 from 6 to 16 (3-6 % faster in four EP 1
    // runs: docs/perf-log.md, forward-v64, v69); qwen3 (16) and gptoss (6) keep their counts,
    // whose neighbours measured within run-to-run noise.
    const double row_bytes = rows * static_cast<double>(shape.hidden) * 2.0;
    ctas = std::max(ctas, std::min(16, static_cast<int>(std::ceil(row_bytes / 60e6))));
  }
  return fit_grid(std::clamp(ctas, 6, 32), grid_sms);
}

int Config::effective_comm_sms_staged_forward(const LayerShape& shape, int device_sms) const {
  if (comm_sms_forward > 0) return comm_sms_forward;
  // EP 1: the staged forward's dispatch (a local copy of the T*K rows; in FP8 their codes and
  // scales) runs alone on the stream, as the staged backward's pulls do: the fused forward's
  // count (sized to share the GPU with GEMM CTAs: qwen3 16, gptoss 6) left the rest of the GPU
  // idle while the FP8 forward's rows moved. EP >= 2: the count validated there. Any count
  // gives the same bits (D2).
  if (shape.ep == 1) {
    if (grid_sms > 0) return grid_sms;
    return device_sms > 0 ? device_sms : 16;
  }
  return effective_comm_sms_forward(shape);
}

int Config::effective_comm_sms_backward(const LayerShape& shape, int device_sms) const {
  if (comm_sms_backward > 0) return comm_sms_backward;
  // EP 1: the staged backward's communication launches (the local pulls of x and dy rows) run
  // alone on the stream, so they take the whole grid: at 16 CTAs the two pulls of dsv3's 940 MB
  // of rows each were most of the backward's time outside its GEMMs (docs/perf-log.md,
  // 2026-12-04). EP >= 2: 16, the count validated there; the whole grid at EP 2 (simulated
  // ranks, 32 and 64 CTAs per rank) hung intermittently in two backward tests on 2026-12-04 and
  // is not understood yet (docs/architecture.md). Any count gives the same bits (D2).
  if (shape.ep == 1) {
    if (grid_sms > 0) return grid_sms;
    return device_sms > 0 ? device_sms : 16;
  }
  return fit_grid(16, grid_sms);
}

int Config::effective_comm_sms_fused_backward(const LayerShape& shape, int device_sms) const {
  if (comm_sms_backward > 0) return comm_sms_backward;
  if (shape.ep == 1) {
    // The dy rows are local and nothing moves after the pull: every CTA but one pulls, then all
    // take GEMM tasks. 1x H200, bf16 grads, 2026-12-04 (6493ff5 and before): gptoss (no shared
    // expert to hide the pull) 9.06-9.56 ms with 131 pulling, 9.22 with 16, 10.72 with the
    // forward's 6; dsv3 and qwen3 within noise of each other (docs/experiments.md).
    const int grid = grid_sms > 0 ? grid_sms : device_sms;
    return grid > 1 ? grid - 1 : 16;
  }
  return effective_comm_sms_forward(shape);  // EP >= 2: the same rows move as in the forward
}

std::string Config::to_string() const {
  std::ostringstream s;
  s << "comm_sms_forward=" << comm_sms_forward << " comm_sms_backward=" << comm_sms_backward
    << " minibatch=" << minibatch << " macrobatch=" << macrobatch << " capacity=" << capacity
    << " grid_sms=" << grid_sms << " wait_timeout_s=" << wait_timeout_s
    << " forward_engine=" << mok::to_string(forward_engine) << " backward_engine=" << mok::to_string(backward_engine)
    << " precision=" << mok::to_string(precision);
  if (precision == Precision::kFp8Block) s << " fp8_weight_grads=" << (fp8_weight_grads ? 1 : 0);
  return s.str();
}

}  // namespace mok
