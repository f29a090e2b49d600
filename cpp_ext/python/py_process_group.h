// ProcessGroupBPS: the c10d ProcessGroup a "byteps" group is, so that torch names it "byteps" and can ask it
// for sequence numbers.
//
// torch registers a third-party backend as BackendType::CUSTOM, and its own ProcessGroup derives two things
// from that type alone (torch/csrc/distributed/c10d/ProcessGroup.hpp): getBackendName() is
// backendTypeToString(CUSTOM), "custom" (what DDP's logging data records), and
// set/getSequenceNumberForGroup() refuse every type but GLOO, NCCL, XCCL and UCC before reaching the backend.
// Both are virtual, so this subclass answers them from the backend instead. torch's group creation
// (_new_process_group_helper) uses a creator's result as the group itself when it is a ProcessGroup, and then
// registers nothing: the constructor registers the backend for cpu and cuda, as torch would have.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>

namespace bps::python {

class ProcessGroupBPS : public c10d::ProcessGroup {
 public:
  // `backend`: the PyBackend, or torch's ProcessGroupWrapper around it (TORCH_DISTRIBUTED_DEBUG=DETAIL).
  ProcessGroupBPS(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                  const c10::intrusive_ptr<c10d::Backend>& backend)
      : c10d::ProcessGroup(store, rank, size) {
    // What torch does for a registered backend it holds itself (_register_backend per device of the
    // backend's capability, the type CUSTOM as the default): `group._device_types` is then [cpu, cuda], and
    // the dispatcher's c10d ops find the backend for either device.
    setDefaultBackend(BackendType::CUSTOM);
    setBackend(c10::DeviceType::CPU, BackendType::CUSTOM, backend);
    setBackend(c10::DeviceType::CUDA, BackendType::CUSTOM, backend);
  }

  const std::string getBackendName() const override { return getDefaultBackend()->getBackendName(); }
  void setSequenceNumberForGroup() override { getDefaultBackend()->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return getDefaultBackend()->getSequenceNumberForGroup(); }
};

}  // namespace bps::python
