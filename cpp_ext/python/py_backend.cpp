// See py_backend.h.
#include "python/py_backend.h"

#include <torch/extension.h>

#include <utility>

#include "python/future_work.h"

namespace py = pybind11;

// Python 3.13 made Py_IsFinalizing public and removed the private _Py_IsFinalizing.
#if PY_VERSION_HEX >= 0x030D0000
#define BPS_PY_IS_FINALIZING() Py_IsFinalizing()
#else
#define BPS_PY_IS_FINALIZING() _Py_IsFinalizing()
#endif

namespace bps::python {

PyBackend::PyBackend(py::object impl, int rank, int size) : c10d::Backend(rank, size), impl_(std::move(impl)) {}

PyBackend::~PyBackend() {
  // torch may drop its last reference without the GIL; while Python shuts down, leak rather than take it.
  if (!Py_IsInitialized() || BPS_PY_IS_FINALIZING()) {
    impl_.release();
    return;
  }
  py::gil_scoped_acquire gil;
  impl_ = py::object();
}

template <typename... Args>
c10::intrusive_ptr<c10d::Work> PyBackend::call(const char* method, std::chrono::milliseconds timeout,
                                               Args&&... args) {
  py::gil_scoped_acquire gil;
  py::object result = impl_.attr(method)(std::forward<Args>(args)...);
  auto work = py::cast<c10::intrusive_ptr<c10d::Work>>(result);
  if (timeout != c10d::kUnsetTimeout) {
    if (auto* ours = dynamic_cast<FutureWork*>(work.get())) ours->setTimeout(timeout);
  }
  return work;
}

template <typename... Args>
c10::intrusive_ptr<c10d::Work> PyBackend::collective(const char* method, std::chrono::milliseconds timeout,
                                                     Args&&... args) {
  ++seqCollective_;
  return call(method, timeout, std::forward<Args>(args)...);
}

void PyBackend::setGroupUid(const std::string& name) {
  c10d::Backend::setGroupUid(name);
  py::gil_scoped_acquire gil;
  impl_.attr("setGroupName")(name);
}

void PyBackend::setTimeout(std::chrono::milliseconds timeout) {
  py::gil_scoped_acquire gil;
  impl_.attr("set_timeout")(timeout.count() / 1000.0);
}

void PyBackend::shutdown() {
  py::gil_scoped_acquire gil;
  impl_.attr("shutdown")();
}

void PyBackend::abort() {
  py::gil_scoped_acquire gil;
  impl_.attr("abort")();
}

c10::intrusive_ptr<c10d::Work> PyBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                    const c10d::BroadcastOptions& opts) {
  return collective("broadcast", opts.timeout, tensors, opts);
}

c10::intrusive_ptr<c10d::Work> PyBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::AllreduceOptions& opts) {
  return collective("allreduce", opts.timeout, tensors, opts);
}

c10::intrusive_ptr<c10d::Work> PyBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                              const c10d::AllreduceCoalescedOptions& opts) {
  return collective("allreduce_coalesced", opts.timeout, tensors, opts);
}

c10::intrusive_ptr<c10d::Work> PyBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  return collective("reduce", opts.timeout, tensors, opts);
}

c10::intrusive_ptr<c10d::Work> PyBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::AllgatherOptions& opts) {
  return collective("allgather", opts.timeout, outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> PyBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                          const c10d::AllgatherOptions& opts) {
  return collective("all_gather_single", opts.timeout, output, input, opts);
}

c10::intrusive_ptr<c10d::Work> PyBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllgatherOptions& opts) {
  return collective("allgather_coalesced", opts.timeout, outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> PyBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                          std::vector<at::Tensor>& inputs,
                                                                          const c10d::AllgatherOptions& opts) {
  return collective("all_gather_single_coalesced", opts.timeout, outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> PyBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                 std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  return collective("gather", opts.timeout, outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> PyBackend::scatter(std::vector<at::Tensor>& outputs,
                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                  const c10d::ScatterOptions& opts) {
  return collective("scatter", opts.timeout, outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> PyBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ReduceScatterOptions& opts) {
  return collective("reduce_scatter", opts.timeout, outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> PyBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                               const c10d::ReduceScatterOptions& opts) {
  return collective("reduce_scatter_single", opts.timeout, output, input, opts);
}

c10::intrusive_ptr<c10d::Work> PyBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                          std::vector<at::Tensor>& inputs,
                                                                          const c10d::ReduceScatterOptions& opts) {
  return collective("reduce_scatter_single_coalesced", opts.timeout, outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> PyBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                        std::vector<int64_t>& outputSplitSizes,
                                                        std::vector<int64_t>& inputSplitSizes,
                                                        const c10d::AllToAllOptions& opts) {
  return collective("all_to_all_single", opts.timeout, output, input, outputSplitSizes, inputSplitSizes, opts);
}

c10::intrusive_ptr<c10d::Work> PyBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                   const c10d::AllToAllOptions& opts) {
  return collective("alltoall", opts.timeout, outputs, inputs, opts);
}

void PyBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  py::gil_scoped_acquire gil;
  impl_.attr("monitored_barrier")(opts, waitAllRanks);
}

c10::intrusive_ptr<c10d::Work> PyBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  return call("send", c10d::kUnsetTimeout, tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> PyBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  return call("recv", c10d::kUnsetTimeout, tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> PyBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return call("recv_anysource", c10d::kUnsetTimeout, tensors, tag);
}

c10::intrusive_ptr<c10d::Work> PyBackend::barrier(const c10d::BarrierOptions& opts) {
  return collective("barrier", opts.timeout, opts);
}

}  // namespace bps::python
