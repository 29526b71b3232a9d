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
  std::vector<std::vector<uint16_t>> y;
  std::mutex mu;
  std::exception_ptr error;

  State(const LayerShape& s, const Config& c) : shape(s), config(c), sync(s.ep + 1), y(s.ep) {}

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
        step(r.rank, *ws, stream, x, gate, up, down, sgate, sup, sdown, y_dev, idx, w);
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
  st.sync.arrive_and_wait();  // step ready
  st.sync.arrive_and_wait();  // step done
  if (st.error) std::rethrow_exception(st.error);
  return st.y;
}

}  // namespace mok::cli
