// torch_bps._C's server part: ServerCore for torch_bps/server/server.py.
//
// ServerCore.run releases the GIL; the control plane's callbacks take it, on the loop thread, and only for
// control messages, ZAP requests, disconnects and ticks: never for PUSH or PULL.
#include <Python.h>
#include <torch/extension.h>

#include <string>
#include <utility>
#include <vector>

#include "server/core.h"
#include "server/rounds.h"

namespace py = pybind11;

namespace bps::python {

using namespace bps::server;
using namespace bps::transport;

namespace {

py::list toList(const std::vector<std::string>& frames) {
  py::list out;
  for (const auto& f : frames) out.append(py::bytes(f));
  return out;
}

std::vector<std::string> toFrames(const py::handle& frames) {
  std::vector<std::string> out;
  if (frames.is_none()) return out;
  for (const auto& f : frames) out.push_back(f.cast<std::string>());
  return out;
}

// The Python callbacks of torch_bps/server/server.py's SummationServer.
class PyControlPlane : public ControlPlane {
 public:
  PyControlPlane(py::object onRequest, py::object onDisconnect, py::object onZap, py::object tick)
      : onRequest_(std::move(onRequest)),
        onDisconnect_(std::move(onDisconnect)),
        onZap_(std::move(onZap)),
        tick_(std::move(tick)) {}

  std::vector<std::string> onRequest(const std::vector<std::string>& frames, const RequestMeta& meta) override {
    py::gil_scoped_acquire gil;
    return toFrames(onRequest_(toList(frames), meta.fd, meta.peerAddress, meta.userId));
  }
  void onDisconnect(int fd) override {
    py::gil_scoped_acquire gil;
    onDisconnect_(fd);
  }
  std::vector<std::string> onZap(const std::vector<std::string>& frames) override {
    py::gil_scoped_acquire gil;
    return toFrames(onZap_(toList(frames)));
  }
  bool tick() override {
    py::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();  // run the signal handlers (SIGTERM: stop)
    return tick_().cast<bool>();
  }

 private:
  py::object onRequest_, onDisconnect_, onZap_, tick_;
};



}  // namespace

void bindServerCore(py::module_& m) {
  py::class_<ServerCore>(m, "ServerCore")
      .def(py::init<uint64_t>(), py::arg("incarnation"))
      .def("set_option", py::overload_cast<int, int64_t>(&ServerCore::setOption), py::arg("option"), py::arg("value"))
      .def(
          "set_option",
          [](ServerCore& core, int option, const py::bytes& value) { core.setOption(option, std::string(value)); },
          py::arg("option"), py::arg("value"))
      .def("enable_zap", &ServerCore::enableZap)
      .def("bind", &ServerCore::bind, py::arg("endpoint"))
      .def("listen_stream", &ServerCore::listenStream, py::arg("host"), py::arg("receive_buffer_bytes") = 0)
      .def_property_readonly("local_stream", &ServerCore::localStream)
      .def(
          "run",
          [](ServerCore& core, py::object onRequest, py::object onDisconnect, py::object onZap, py::object tick,
             double tickSeconds) {
            PyControlPlane control(std::move(onRequest), std::move(onDisconnect), std::move(onZap),
                                        std::move(tick));
            py::gil_scoped_release release;
            core.run(control, tickSeconds);
          },
          "Serve until tick() returns False: on_request(frames, fd, peer_address, user_id) -> reply frames or None; "
          "on_disconnect(fd); on_zap(frames) -> reply frames; tick() -> bool, every tick_seconds.",
          py::arg("on_request"), py::arg("on_disconnect"), py::arg("on_zap"), py::arg("tick"),
          py::arg("tick_seconds"))
      .def("hello", &ServerCore::hello, py::arg("job_id"), py::arg("worker"), py::arg("num_workers"),
           py::arg("backups"), py::arg("window"), py::arg("staleness"), py::arg("peer"), py::arg("identity"))
      .def("touch", &ServerCore::touch, py::arg("job_id"), py::arg("worker"))
      .def("declare", &ServerCore::declare, py::arg("job_id"), py::arg("key"), py::arg("nbytes"), py::arg("dtype"),
           py::arg("mode"), py::arg("codec") = 0, py::arg("dense_bytes") = 0)
      .def("worker_lost", &ServerCore::workerLost, py::arg("job_id"), py::arg("worker"), py::arg("how"))
      .def("refuse", &ServerCore::refuse, py::arg("job_id"), py::arg("key"), py::arg("worker"), py::arg("round"),
           py::arg("reason"))
      .def("forget_job", &ServerCore::forgetJob, py::arg("job_id"), py::arg("message"))
      .def("take_touched", &ServerCore::takeTouched)
      .def("counters",
           [](const ServerCore& core) {
             const CoreCounters& c = core.counters();
             return py::dict(py::arg("pushes") = c.pushes, py::arg("pulls") = c.pulls, py::arg("bytes_in") = c.bytesIn,
                             py::arg("bytes_out") = c.bytesOut, py::arg("bytes_summed") = c.sums.bytesSummed,
                             py::arg("sum_ns") = c.sums.sumNs, py::arg("errors") = c.errors,
                             py::arg("sums") = c.sumCount, py::arg("requests") = c.requests,
                             py::arg("wakeups") = c.wakeups, py::arg("keys_waiting") = core.keysWaiting());
           })
      .def(
          "job_counters",
          [](const ServerCore& core) {
            py::dict out;
            for (const auto& [jobId, c] : core.jobCounters()) {
              out[py::int_(jobId)] = py::dict(
                  py::arg("pushes") = c.pushes, py::arg("pulls") = c.pulls, py::arg("bytes_in") = c.bytesIn,
                  py::arg("bytes_out") = c.bytesOut, py::arg("bytes_summed") = c.bytesSummed,
                  py::arg("sum_ns") = c.sumNs, py::arg("errors") = c.errors, py::arg("sums") = c.sums,
                  py::arg("late_pushes") = c.latePushes);
            }
            return out;
          },
          "{job id: its counters} for every job registered here.")
      .def(
          "trace",
          [](ServerCore& core, size_t capacity) {
            uint64_t dropped = 0;
            at::Tensor events = core.trace().take(capacity, &dropped);
            return std::make_tuple(events, dropped);
          },
          "(events [n, 8] int64, dropped) recorded since the last call; record up to `capacity` more (0: stop). "
          "See cpp_ext/common/trace.h.",
          py::arg("capacity"));
}

}  // namespace bps::python
