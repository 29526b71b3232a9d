// The deterministic task list of the fused forward's GEMM CTAs (docs/megakernel.md). The tasks are
// handed out in increasing order through one counter (whichever GEMM CTA, or comm CTA done with
// its dispatch, asks next; fused_roles.cuh, task_feeder), and a task only waits on tasks with a
// smaller index (or on the communication CTAs' dispatch, which never waits on a GEMM), all
// handed out before it. With
// every CTA co-resident, the unfinished task of smallest index can always run, so the kernel
// cannot deadlock.
//
// Order (each block rasterised in groups of kGroupM row tiles, row tiles fastest, so CTAs running
// at the same time share a weight column block; the routed groups never span two experts, so
// the CTAs streaming one expert's weight block run it together: dsv3 EP 1 DRAM reads 32 -> 27 GB
// per pass, the pass 2.6 % faster, gptoss 3.9 %, qwen3 0.7 %, docs/megakernel.md):
//   S1   shared expert GEMM1+SwiGLU, every row tile of the rank's T tokens   (no wait)
//   S2   shared expert GEMM2                                                  (waits: S1 row tile)
//   G1(0)                                                                     (waits: ready[0])
//   G1(1) G2(0)  G1(2) G2(1) ... G1(M-1) G2(M-2)                              (G2(m) waits: G1 row tile)
//   G2(M-1)
//   WS   the fused backward only: the shared expert's weight-gradient tiles   (waits: every S1 row tile)
//   W    the fused backward only: the routed weight-gradient tiles            (waits: the expert's G1 row tiles)
// The shared tiles come first: they hide the dispatch of the first minibatch. GEMM2 of a
// minibatch trails its GEMM1 by one minibatch of GEMM1 work, so its hidden rows are usually
// complete when a CTA takes it. Which CTA computes a tile never changes how: the bits do not
// depend on the order, the grid or the minibatch (docs/determinism.md).
#pragma once

#include <cstdint>

#include "gemm/tile_scheduler.cuh"

namespace mok::megakernel {

// kSharedWgrad / kWgrad: the K-grouped weight-gradient tiles of the fused backward (its second
// phase, after every dgrad task of the list: backward_wgrad.cuh).
enum class TaskKind : int { kSharedGemm1 = 0, kSharedGemm2 = 1, kGemm1 = 2, kGemm2 = 3, kSharedWgrad = 4, kWgrad = 5 };

struct Task {
  TaskKind kind;
  int row_tile;   // shared: tile of the rank's tokens; routed: global row tile of the expert-major buffer
  int n_tile;     // output column block; weight gradients: the tile of the wgrad launch (KGroupedScheduler::tile)
  int minibatch;  // routed only
};

__device__ __forceinline__ bool is_gemm1(TaskKind k) { return k == TaskKind::kSharedGemm1 || k == TaskKind::kGemm1; }
__device__ __forceinline__ bool is_shared(TaskKind k) {
  return k == TaskKind::kSharedGemm1 || k == TaskKind::kSharedGemm2 || k == TaskKind::kSharedWgrad;
}
__device__ __forceinline__ bool is_wgrad(TaskKind k) { return k == TaskKind::kSharedWgrad || k == TaskKind::kWgrad; }

struct TaskList {
  // Host constants.
  int shared_row_tiles = 0;     // ceil(T / 128); 0 without a shared expert
  int shared_n1 = 0;            // ceil(I_shared / 128): column blocks of shared GEMM1 (gate|up pairs)
  int n1 = 0;                   // ceil(I / 128): column blocks of routed GEMM1
  int n2 = 0;                   // ceil(H / 256): column blocks of every GEMM2
  int tiles_per_minibatch = 1;  // Config::effective_minibatch / 128
  int group_m = gemm::kGroupM;
  int shared_wgrad_tiles = 0;   // fused backward with the weight gradients in the kernel: the tiles
  int wgrad_tiles = 0;          // of the shared and the routed wgrad launch (shapes only); else 0
  // Per pass, from the schedule (all CTAs derive the same values).
  int routed_row_tiles = 0;
  int minibatches = 0;
  const int32_t* offsets = nullptr;  // the GEMM segment table (device)
  int experts = 0;

  // Sets the per-pass counts from the GEMM segment table (offsets[experts] = padded rows;
  // 0 when the schedule was poisoned).
  __device__ void set_routed_rows(const int32_t* seg_offsets, int seg_experts) {
    offsets = seg_offsets;
    experts = seg_experts;
    routed_row_tiles = __ldg(offsets + experts) / gemm::kRowTileRows;
    minibatches = (routed_row_tiles + tiles_per_minibatch - 1) / tiles_per_minibatch;
  }

  __device__ int rows_of(int m) const { return min(tiles_per_minibatch, routed_row_tiles - m * tiles_per_minibatch); }
  __device__ int shared_tasks() const { return shared_row_tiles * (shared_n1 + n2); }
  __device__ int dgrad_size() const { return shared_tasks() + routed_row_tiles * (n1 + n2); }  // (forward: all)
  __device__ int size() const { return dgrad_size() + shared_wgrad_tiles + wgrad_tiles; }

  __device__ Task at(int i) const {
    const int w = i - dgrad_size();
    if (w >= 0) {
      return w < shared_wgrad_tiles ? Task{TaskKind::kSharedWgrad, 0, w, 0}
                                    : Task{TaskKind::kWgrad, 0, w - shared_wgrad_tiles, 0};
    }
    const int s1 = shared_row_tiles * shared_n1;
    if (i < s1) return make(TaskKind::kSharedGemm1, 0, shared_row_tiles, shared_n1, 0, i);
    i -= s1;
    const int s2 = shared_row_tiles * n2;
    if (i < s2) return make(TaskKind::kSharedGemm2, 0, shared_row_tiles, n2, 0, i);
    i -= s2;
    // G1(0)
    const int a0 = rows_of(0) * n1;
    if (i < a0) return gemm1(0, i);
    i -= a0;
    // Full pairs j = 1 .. M-2: G1(j) then G2(j-1), both of tiles_per_minibatch row tiles.
    const int full = max(minibatches - 2, 0);
    const int g1_full = tiles_per_minibatch * n1;
    const int pair = g1_full + tiles_per_minibatch * n2;
    if (i < full * pair) {
      const int j = 1 + i / pair, l = i % pair;
      return l < g1_full ? gemm1(j, l) : gemm2(j - 1, l - g1_full);
    }
    i -= full * pair;
    if (minibatches >= 2) {  // last pair: G1(M-1) (maybe partial) then G2(M-2)
      const int last = minibatches - 1;
      const int a = rows_of(last) * n1;
      if (i < a) return gemm1(last, i);
      i -= a;
      const int b = rows_of(last - 1) * n2;
      if (i < b) return gemm2(last - 1, i);
      i -= b;
    }
    return gemm2(minibatches - 1, i);
  }

 private:
  __device__ Task make(TaskKind kind, int first_row_tile, int row_tiles, int n_tiles, int m, int l) const {
    int r, n;
    gemm::raster_group(l, row_tiles, n_tiles, group_m, r, n);
    return Task{kind, first_row_tile + r, n, m};
  }
  // Routed tiles of minibatch m: raster groups aligned to experts.
  __device__ Task routed(TaskKind kind, int m, int n_tiles, int l) const {
    int rt, n;
    gemm::raster_expert_groups(l, m * tiles_per_minibatch, rows_of(m), n_tiles, group_m, offsets, experts, rt, n);
    return Task{kind, rt, n, m};
  }
  __device__ Task gemm1(int m, int l) const { return routed(TaskKind::kGemm1, m, n1, l); }
  __device__ Task gemm2(int m, int l) const { return routed(TaskKind::kGemm2, m, n2, l); }
};

}  // namespace mok::megakernel
