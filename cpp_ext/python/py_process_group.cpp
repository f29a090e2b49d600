// See py_process_group.h.
#include "python/py_process_group.h"

namespace bps::python {

ProcessGroupBPS::ProcessGroupBPS(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 const c10::intrusive_ptr<c10d::Backend>& backend)
    : c10d::ProcessGroup(store, rank, size) {
  // What torch does for a registered backend it holds itself (_register_backend per device of the
  // backend's capability, the type CUSTOM as the default): `group._device_types` is then [cpu, cuda], and
  // the dispatcher's c10d ops find the backend for either device.
  setDefaultBackend(BackendType::CUSTOM);
  setBackend(c10::DeviceType::CPU, BackendType::CUSTOM, backend);
  setBackend(c10::DeviceType::CUDA, BackendType::CUSTOM, backend);
}

}  // namespace bps::python
