#include "gpu_layer.hpp"

#include <cuda_runtime_api.h>

#include <barrier>
#include <exception>
#include <mutex>
#include <thread>

#include "mok/api.hpp"
#include "mok/bootstrap.hpp"

namespace mok::cli {
namespace {

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(Status::kCudaError, std::string(what) + ": " + cudaGetErrorString(e));
}

// A device copy of a host vector, re-uploaded each step.
template <class T>
struct DeviceVec {
  T* p = nullptr;
  size_t n = 0;
  void upload(const T* src, size_t count, cudaStream_t s) {
    if (count != n) {
      if (p) cudaFree(p);
      p = nullptr;
      n = count;
      if (n) cuda_ok(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc");
    }
    if (n) cuda_ok(cudaMemcpyAsync(p, src, n * sizeof(T), cudaMemcpyHostToDevice, s), "cudaMemcpyAsync");
  }
  ~DeviceVec() {
    if (p) cudaFree(p);
  }
};

}  // namespace

struct GpuLayer::State {
  LayerShape shape;
  Config config;
  std::barrier<> sync;  // main thread + one per rank: "step ready", then "step done"
  std::thread driver;
  bool stop = false;
  const ref::LayerWeights* weights = nullptr;
  const ref::LayerInputs* inputs = nullptr;
  const std::vector<std::vector<uint16_t>>* dy = nullptr;  // set: this step is the backward
  std::vector<std::vector<uint16_t>> y;
  ref::Gradients grads;  // the backward's, assembled from every rank
  std::mutex mu;
  std::exception_ptr error;

  State(const LayerShape& s, const Config& c) : shape(s), config(c), sync(s.ep + 1), y(s.ep) {
    grads.dx.resize(s.ep);
    grads.dtopk_w.resize(s.ep);
    grads.dgate.assign(size_t(s.experts) * s.intermediate * s.hidden, 0.f);
    grads.dup.assign(grads.dgate.size(), 0.f);
    grads.ddown.assign(grads.dgate.size(), 0.f);
    if (s.has_shared()) {
      grads.shared_dgate.resize(s.ep);
      grads.shared_dup.resize(s.ep);
      grads.shared_ddown.resize(s.ep);
    }
  }

  void record(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!error) error = e;
  }

  void rank_loop(bootstrap::LocalRank& r) {
    std::unique_ptr<Workspace> ws;
    cudaStream_t stream = nullptr;
    try {
      cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate");
      ws = Workspace::create(shape, config, r.comm, r.device);
    } catch (...) {
      record(std::current_exception());
    }
    DeviceVec<uint16_t> x, gate, up, down, sgate, sup, sdown, y_dev;
    DeviceVec<int32_t> idx;
    DeviceVec<float> w;
    for (;;) {
      sync.arrive_and_wait();  // step ready (or stop)
      if (stop) break;
      try {
        if (!ws) throw Error(Status::kInternal, "workspace creation failed on rank " + std::to_string(r.rank));
        if (dy != nullptr) {
          backward_step(r.rank, *ws, stream, x, gate, up, down, sgate, sup, sdown, w);
        } else {
          step(r.rank, *ws, stream, x, gate, up, down, sgate, sup, sdown, y_dev, idx, w);
        }
      } catch (...) {
        record(std::current_exception());
      }
      sync.arrive_and_wait();  // step done
    }
    ws.reset();
    if (stream) cudaStreamDestroy(stream);
  }

  void step(int rank, Workspace& ws, cudaStream_t s, DeviceVec<uint16_t>& x, DeviceVec<uint16_t>& gate,
            DeviceVec<uint16_t>& up, DeviceVec<uint16_t>& down, DeviceVec<uint16_t>& sgate, DeviceVec<uint16_t>& sup,
            DeviceVec<uint16_t>& sdown, DeviceVec<uint16_t>& y_dev, DeviceVec<int32_t>& idx, DeviceVec<float>& w) {
    const LayerShape& sh = shape;
    const size_t expert_in = size_t(sh.intermediate) * sh.hidden, el = size_t(sh.local_experts());
    const size_t first = size_t(rank) * el;
    gate.upload(weights->gate.data() + first * expert_in, el * expert_in, s);
    up.upload(weights->up.data() + first * expert_in, el * expert_in, s);
    down.upload(weights->down.data() + first * expert_in, el * expert_in, s);
    sgate.upload(weights->shared_gate.data(), weights->shared_gate.size(), s);
    sup.upload(weights->shared_up.data(), weights->shared_up.size(), s);
    sdown.upload(weights->shared_down.data(), weights->shared_down.size(), s);
    x.upload(inputs->x[rank].data(), inputs->x[rank].size(), s);
    idx.upload(inputs->topk_idx[rank].data(), inputs->topk_idx[rank].size(), s);
    w.upload(inputs->topk_w[rank].data(), inputs->topk_w[rank].size(), s);
    std::vector<uint16_t> y_host(size_t(sh.tokens) * sh.hidden);
    y_dev.upload(y_host.data(), y_host.size(), s);  // sizes the buffer; forward overwrites it
    auto b = [](const DeviceVec<uint16_t>& v) { return reinterpret_cast<const bf16*>(v.p); };
    const ExpertWeights ew{b(gate), b(up), b(down), b(sgate), b(sup), b(sdown)};
    mok::schedule(ws, idx.p, s);
    mok::forward(ws, ForwardArgs{b(x), w.p, reinterpret_cast<bf16*>(y_dev.p)}, ew, s);
    ws.check();
    cuda_ok(cudaMemcpy(y_host.data(), y_dev.p, y_host.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy y");
    y[rank] = std::move(y_host);
  }

  // The GPU backward over the forward's context (the workspace's own): dx, d topk_w and the
  // weight gradients added into zeroed fp32 buffers (GradMode::kAccumulateFp32).
  void backward_step(int rank, Workspace& ws, cudaStream_t s, DeviceVec<uint16_t>& x, DeviceVec<uint16_t>& gate,
                     DeviceVec<uint16_t>& up, DeviceVec<uint16_t>& down, DeviceVec<uint16_t>& sgate,
                     DeviceVec<uint16_t>& sup, DeviceVec<uint16_t>& sdown, DeviceVec<float>& w) {
    const LayerShape& sh = shape;
    const size_t routed = size_t(sh.local_experts()) * sh.intermediate * sh.hidden;
    const size_t shared = size_t(sh.shared_intermediate) * sh.hidden;
    DeviceVec<uint16_t> dy_dev, dx_dev;
    DeviceVec<float> dtopk, dgate, dup, ddown, sdgate, sdup, sddown;
    dy_dev.upload((*dy)[rank].data(), (*dy)[rank].size(), s);
    const std::vector<uint16_t> zeros16(size_t(sh.tokens) * sh.hidden);
    dx_dev.upload(zeros16.data(), zeros16.size(), s);
    const std::vector<float> zr(routed), zs(shared), zk(size_t(sh.tokens) * sh.topk);
    dtopk.upload(zk.data(), zk.size(), s);
    dgate.upload(zr.data(), routed, s);
    dup.upload(zr.data(), routed, s);
    ddown.upload(zr.data(), routed, s);
    sdgate.upload(zs.data(), shared, s);
    sdup.upload(zs.data(), shared, s);
    sddown.upload(zs.data(), shared, s);
    auto b = [](const DeviceVec<uint16_t>& v) { return reinterpret_cast<const bf16*>(v.p); };
    const ExpertWeights ew{b(gate), b(up), b(down), b(sgate), b(sup), b(sdown)};
    const WeightGrads wg{GradMode::kAccumulateFp32, dgate.p, dup.p, ddown.p, sdgate.p, sdup.p, sddown.p};
    mok::backward(ws, BackwardArgs{b(x), w.p, b(dy_dev), reinterpret_cast<bf16*>(dx_dev.p), dtopk.p}, ew, wg, s);
    ws.check();
    auto down_f = [&](const DeviceVec<float>& v, float* dst) {
      if (v.n) cuda_ok(cudaMemcpy(dst, v.p, v.n * 4, cudaMemcpyDeviceToHost), "cudaMemcpy grads");
    };
    grads.dx[rank].resize(zeros16.size());
    cuda_ok(cudaMemcpy(grads.dx[rank].data(), dx_dev.p, zeros16.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy dx");
    grads.dtopk_w[rank].resize(zk.size());
    down_f(dtopk, grads.dtopk_w[rank].data());
    down_f(dgate, grads.dgate.data() + rank * routed);  // this rank's experts of the global view
    down_f(dup, grads.dup.data() + rank * routed);
    down_f(ddown, grads.ddown.data() + rank * routed);
    if (sh.has_shared()) {
      grads.shared_dgate[rank].resize(shared);
      grads.shared_dup[rank].resize(shared);
      grads.shared_ddown[rank].resize(shared);
      down_f(sdgate, grads.shared_dgate[rank].data());
      down_f(sdup, grads.shared_dup[rank].data());
      down_f(sddown, grads.shared_ddown[rank].data());
    }
  }
};

GpuLayer::GpuLayer(const LayerShape& shape, const Config& config) : state_(std::make_unique<State>(shape, config)) {
  std::vector<int> devices(shape.ep);
  for (int r = 0; r < shape.ep; ++r) devices[r] = r;
  State* st = state_.get();
  st->driver = std::thread([st, devices] {
    try {
      bootstrap::run_local_ranks(devices, [st](bootstrap::LocalRank& r) { st->rank_loop(r); });
    } catch (...) {
      st->record(std::current_exception());
    }
  });
}

GpuLayer::~GpuLayer() {
  state_->stop = true;
  state_->sync.arrive_and_wait();
  state_->driver.join();
}

std::vector<std::vector<uint16_t>> GpuLayer::forward(const ref::LayerWeights& weights, const ref::LayerInputs& inputs) {
  State& st = *state_;
  st.weights = &weights;
  st.inputs = &inputs;
  st.dy = nullptr;
  st.sync.arrive_and_wait();  // step ready
  st.sync.arrive_and_wait();  // step done
  if (st.error) std::rethrow_exception(st.error);
  return st.y;
}

ref::Gradients GpuLayer::backward(const std::vector<std::vector<uint16_t>>& dy) {
  State& st = *state_;
  st.dy = &dy;
  st.sync.arrive_and_wait();  // step ready
  st.sync.arrive_and_wait();  // step done
  st.dy = nullptr;
  if (st.error) std::rethrow_exception(st.error);
  return st.grads;
}

}  // namespace mok::cli
