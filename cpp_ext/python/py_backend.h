// PyBackend: the c10d::Backend torch registers for "byteps" on cpu and cuda, its collectives methods of a
// Python object (torch_bps.process_group.BackendBPS).
//
// torch wants a real Backend: its own ProcessGroup then holds it per device, which is what fills
// `group._device_types` and what DCP, FSDP2's state-dict broadcast and the dispatcher's c10d ops look up.
// Python cannot subclass c10d::Backend (no constructor is bound), so this class forwards each virtual to
// the Python method of the same name torch's ProcessGroup uses (allreduce, all_gather_single, send...),
// with the GIL taken. The Python method returns the Work; a per-call timeout (opts.timeout) is applied here,
// in one place, to the Works torch_bps makes. Python exceptions pass through to the caller unchanged.
//
// Sequence numbers (what TORCH_DISTRIBUTED_DEBUG=DETAIL's ProcessGroupWrapper stamps on each collective's
// fingerprint) count collectives as NCCL does: every rank starts at 0 and adds one per collective call,
// point-to-point excluded, since ranks make different numbers of sends and receives.
#pragma once

#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

namespace bps::python {

class PyBackend : public c10d::Backend {
 public:
  PyBackend(pybind11::object impl, int rank, int size);
  ~PyBackend() override;

  // The Python object this Backend forwards to (GIL held by the caller).
  pybind11::object impl() const { return impl_; }

  const std::string getBackendName() const override { return "byteps"; }
  void setGroupUid(const std::string& name) override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void shutdown() override;
  void abort() override;
  // Nothing to agree on: every rank counts from 0 (NCCL's rule), and the wrapper calls this at construction.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seqCollective_.load(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

 private:
  // impl_.<method>(args...) with the GIL; the Work it returns, given `timeout` unless that is unset.
  template <typename... Args>
  c10::intrusive_ptr<c10d::Work> call(const char* method, std::chrono::milliseconds timeout, Args&&... args);
  // `call` of a collective: counted in the sequence number first, as the wrapper reads it before the call.
  template <typename... Args>
  c10::intrusive_ptr<c10d::Work> collective(const char* method, std::chrono::milliseconds timeout, Args&&... args);

  pybind11::object impl_;
  std::atomic<uint64_t> seqCollective_{0};
};

}  // namespace bps::python
