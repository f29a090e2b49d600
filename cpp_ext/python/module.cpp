// The Python module torch_bps._C: the push/pull client, the c10d Backend and Work, and (server_bindings.cpp,
// testing.cpp) the server's core and the test-only submodule _testing.
//
// Every call into the client runs with the GIL released. Completions come back on CompletionPool threads,
// which take the GIL to call the Python handler given at construction. bps::Error and ErrorInfo map to the
// types of torch_bps/errors.py here and nowhere else.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "client/client.h"
#include "common/errors.h"
#include "python/future_work.h"
#include "python/py_backend.h"
#include "python/py_process_group.h"
#include "transport/wire.h"

namespace py = pybind11;

// One partition as Python passes it: the fields of client::PartSpec (torch_bps.wire.Partition's, then the dtype's
// wire code), in order.
using PartTuple = std::tuple<at::Tensor, uint64_t, size_t, at::Tensor, uint32_t, int64_t, int64_t, int64_t, uint32_t,
                             int64_t, uint16_t>;

namespace bps::python {

using namespace bps::client;
using namespace bps::transport;

namespace {

// Build the Python exception for `error` (GIL held).
py::object toPyException(const ErrorInfo& error) {
  py::module_ errors = py::module_::import("torch_bps.errors");
  switch (error.kind) {
    case ErrorKind::kTransport: return errors.attr("TransportError")(error.message);
    case ErrorKind::kTimeout: return errors.attr("BpsTimeoutError")(error.message);
    // A sum that waited its timeout for workers that have not pushed: a timeout, the server's words.
    case ErrorKind::kServer:
      if (error.status == kRoundTimeout) return errors.attr("BpsTimeoutError")(error.message);
      return errors.attr("ServerError")(error.status, error.message);
    case ErrorKind::kProtocol: return errors.attr("ProtocolError")(error.status, error.message);
    case ErrorKind::kValue: return py::module_::import("builtins").attr("ValueError")(error.message);
    default: return errors.attr("BpsError")(error.message);
  }
}

// An exception_ptr that, wherever it is rethrown (DDP's reducer, Work::wait, Future.wait), becomes `error`
// again in Python: torch translates its python_error back into the original exception object (GIL held).
std::exception_ptr asErrorPtr(const py::object& error) {
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  python_error e;
  e.persist();
  e.build_message();
  return std::make_exception_ptr(e);
}

// detach(): the client holds its own TensorImpls, never the ones owned by Python objects, so dropping them (on
// ZeroMQ's thread, for a sent payload) never needs the GIL.
PartSpec toPartSpec(const PartTuple& p) {
  return PartSpec{std::get<0>(p).detach(), std::get<1>(p), std::get<2>(p), std::get<3>(p).detach(),
                  static_cast<Mode>(std::get<4>(p)), std::get<5>(p), std::get<6>(p), std::get<7>(p),
                  std::get<8>(p), std::get<9>(p), std::get<10>(p)};
}

c10::intrusive_ptr<c10::ivalue::Future> cppFuture(const py::object& future) {
  return py::cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>(future)->fut;
}

// Fail a torch.futures.Future in C++ (setError), which Future.set_exception does not: it stores the
// exception as the future's value, and C++ consumers then read an exception object as a tensor.
void failFuture(const py::object& future, const py::object& error) {
  auto fut = cppFuture(future);
  std::exception_ptr eptr = asErrorPtr(error);
  py::gil_scoped_release release;  // callbacks run here and take the GIL themselves
  fut->setErrorIfNeeded(eptr);
}

c10::intrusive_ptr<c10d::Work> makeWork(const py::object& future, double timeoutSeconds, std::string what,
                                        py::object onTaken) {
  auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000));
  auto makeTimeoutError = [](const std::string& message) {
    py::gil_scoped_acquire gil;
    return asErrorPtr(py::module_::import("torch_bps.errors").attr("BpsTimeoutError")(message));
  };
  FutureWork::Taken taken;
  if (!onTaken.is_none()) {
    // The Work may die on a thread without the GIL (DDP's reducer): drop the callable with the GIL held.
    std::shared_ptr<py::object> fn(new py::object(std::move(onTaken)), [](py::object* p) {
      py::gil_scoped_acquire gil;
      delete p;
    });
    taken = [fn] {  // runs with the GIL held (FutureWork::getFuture)
      try {
        (*fn)();
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("torch_bps: a Work's on_taken");
      }
    };
  }
  return c10::make_intrusive<FutureWork>(cppFuture(future), timeout, std::move(what), makeTimeoutError,
                                         std::move(taken));
}

// Owns a client::Client for Python: releases the GIL while closing, since closing runs completions that
// need it.
class PyClient {
 public:
  PyClient(std::vector<std::string> servers, uint64_t jobId, uint32_t worker, uint32_t numWorkers, double timeout,
           double heartbeatInterval, double heartbeatTimeout, py::function onComplete, ClientCredentials credentials,
           int64_t creditBytes, int64_t serverCreditBytes = 0, int socketBufferBytes = 0, bool failover = false,
           py::object onLinkDown = py::none(), bool stream = false, bool autoCredit = false,
           std::vector<int> receiveBufferBytes = {}, bool localStream = true, bool sharedMemory = true,
           uint32_t backups = 0, uint32_t window = 2, uint64_t staleness = 0) {
    // The handler outlives no GIL-holding scope safely on its own: drop the Python callable only with the
    // GIL held, whichever thread lets go of it last.
    std::shared_ptr<py::object> handler(new py::object(std::move(onComplete)), [](py::object* p) {
      py::gil_scoped_acquire gil;
      delete p;
    });
    auto complete = [handler](uint64_t token, const ErrorInfo& error) {
      py::gil_scoped_acquire gil;
      try {
        (*handler)(token, error.ok() ? py::none() : toPyException(error));
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("torch_bps completion handler");
      }
    };
    LinkDownHandler linkDown;
    if (!onLinkDown.is_none()) {
      std::shared_ptr<py::object> held(new py::object(std::move(onLinkDown)), [](py::object* p) {
        py::gil_scoped_acquire gil;
        delete p;
      });
      linkDown = [held](size_t server, const std::string& why) {
        py::gil_scoped_acquire gil;
        try {
          (*held)(server, why);
        } catch (py::error_already_set& e) {
          e.discard_as_unraisable("torch_bps link-down handler");
        }
      };
    }
    ClientOptions options{std::move(servers), jobId,           worker,           numWorkers,     timeout,
                          heartbeatInterval,  heartbeatTimeout, std::move(credentials), creditBytes};
    options.serverCreditBytes = serverCreditBytes;
    options.socketBufferBytes = socketBufferBytes;
    options.receiveBufferBytes = std::move(receiveBufferBytes);
    options.failover = failover;
    options.stream = stream;
    options.localStream = localStream;
    options.sharedMemory = sharedMemory;
    options.autoCredit = autoCredit;
    options.backups = backups;
    options.window = window;
    options.staleness = staleness;
    py::gil_scoped_release release;
    client_ = std::make_unique<Client>(std::move(options), std::move(complete), std::move(linkDown));
  }

  ~PyClient() {
    py::gil_scoped_release release;
    client_.reset();
  }

  Client& get() { return *client_; }

  // Run fn on a completion thread (with the GIL), like a push_pull's completion.
  void post(py::function fn) {
    std::shared_ptr<py::object> held(new py::object(std::move(fn)), [](py::object* p) {
      py::gil_scoped_acquire gil;
      delete p;
    });
    // Keeps the GIL: posting never waits on a task (the pool runs none under its lock), and letting go of the GIL
    // here hands it to the very thread just woken, so the caller would wait a switch interval to get it back.
    client_->post([held] {
      py::gil_scoped_acquire gil;
      try {
        (*held)();
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("torch_bps posted task");
      }
    });
  }

 private:
  std::unique_ptr<Client> client_;
};


}  // namespace

// The module's other parts: each binds its classes into the module it is given.
// ServerCore, for torch_bps/server/server.py (server_bindings.cpp).
void bindServerCore(py::module_& m);
// torch_bps._C._testing: what only the tests call (testing.cpp).
void bindTesting(py::module_& m);

}  // namespace bps::python

PYBIND11_MODULE(_C, m) {
  using bps::python::PyClient;
  using release = py::call_guard<py::gil_scoped_release>;
  m.doc() = "torch_bps C++ push/pull client (use torch_bps.client.Client)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const bps::Error& e) {
      py::object exc = bps::python::toPyException(e.info());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.def("fail_future", &bps::python::failFuture,
        "Complete a torch.futures.Future with `error` as a C++ error, so C++ consumers (DDP) see a failure.",
        py::arg("future"), py::arg("error"));
  m.def("make_work", &bps::python::makeWork,
        "A c10d Work over `future`: wait(timeout) rethrows its error, get_future() works from C++ too; "
        "`on_taken()` runs the first time Python takes its future.",
        py::arg("future"), py::arg("timeout"), py::arg("what"), py::arg("on_taken") = py::none());
  m.def(
      "make_backend",
      [](py::object impl, int rank, int size) -> c10::intrusive_ptr<c10d::Backend> {
        return c10::make_intrusive<bps::python::PyBackend>(std::move(impl), rank, size);
      },
      "A c10d Backend (for ProcessGroup._register_backend) whose collectives are `impl`'s methods.",
      py::arg("impl"), py::arg("rank"), py::arg("size"));
  m.def(
      "backend_impl",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) -> py::object {
        auto* ours = dynamic_cast<bps::python::PyBackend*>(backend.get());
        return ours != nullptr ? ours->impl() : py::none();
      },
      "The Python object behind a Backend made by make_backend, else None.", py::arg("backend"));
  m.def(
      "make_process_group",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
         const c10::intrusive_ptr<c10d::Backend>& backend) -> c10::intrusive_ptr<c10d::ProcessGroup> {
        return c10::make_intrusive<bps::python::ProcessGroupBPS>(store, rank, size, backend);
      },
      "The ProcessGroup a creator returns: `backend` for cpu and cuda, named by it, its sequence numbers.",
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("backend"));



  py::class_<PyClient>(m, "Client")
      .def(py::init([](std::vector<std::string> servers, uint64_t jobId, uint32_t worker, uint32_t numWorkers,
                       double timeout, double heartbeatInterval, double heartbeatTimeout, py::function onComplete,
                       std::string identity, std::string curveSecret, std::vector<std::string> curveServerKeys,
                       std::vector<std::string> tokens, int64_t creditBytes, int64_t serverCreditBytes,
                       int socketBufferBytes, bool failover, py::object onLinkDown, bool stream, bool autoCredit,
                       std::vector<int> receiveBufferBytes, bool localStream, bool sharedMemory, uint32_t backups,
                       uint32_t window, uint64_t staleness) {
             // torch_bps.security.ClientCredentials, field for field (credentials.h).
             bps::python::ClientCredentials credentials{std::move(identity), std::move(curveSecret),
                                                        std::move(curveServerKeys), std::move(tokens)};
             return new PyClient(std::move(servers), jobId, worker, numWorkers, timeout, heartbeatInterval,
                                 heartbeatTimeout, std::move(onComplete), std::move(credentials), creditBytes,
                                 serverCreditBytes, socketBufferBytes, failover, std::move(onLinkDown), stream,
                                 autoCredit, std::move(receiveBufferBytes), localStream, sharedMemory, backups,
                                 window, staleness);
           }),
           py::arg("servers"), py::arg("job_id"), py::arg("worker"), py::arg("num_workers"), py::arg("timeout"),
           py::arg("heartbeat_interval"), py::arg("heartbeat_timeout"), py::arg("on_complete"),
           py::arg("identity") = "", py::arg("curve_secret") = "",
           py::arg("curve_server_keys") = std::vector<std::string>{}, py::arg("tokens") = std::vector<std::string>{},
           py::arg("credit_bytes") = bps::python::ClientOptions{}.creditBytes, py::arg("server_credit_bytes") = 0,
           py::arg("socket_buffer_bytes") = 0, py::arg("failover") = false, py::arg("on_link_down") = py::none(),
           py::arg("stream") = false, py::arg("auto_credit") = false,
           py::arg("receive_buffer_bytes") = std::vector<int>{}, py::arg("local_stream") = true,
           py::arg("shared_memory") = true, py::arg("backups") = 0, py::arg("window") = 2,
           py::arg("staleness") = 0)
      .def("hello", [](PyClient& c, double timeout) { return c.get().hello(timeout); }, py::arg("timeout"), release())
      .def(
          "push_pull",
          [](PyClient& c, uint64_t token, const PartTuple& part, uint64_t pushedToken) {
            c.get().pushPull(token, bps::python::toPartSpec(part), pushedToken);
          },
          py::arg("token"), py::arg("part"), py::arg("pushed_token") = 0, release())
      .def(
          "push_pull_batch",
          [](PyClient& c, uint64_t token, const std::vector<PartTuple>& parts, int64_t priority,
             std::optional<at::Tensor> outcomes) {
            std::vector<bps::python::PartSpec> specs;
            specs.reserve(parts.size());
            for (const auto& p : parts) specs.push_back(bps::python::toPartSpec(p));
            c.get().pushPullBatch(token, std::move(specs), priority, outcomes ? outcomes->detach() : at::Tensor());
          },
          py::arg("token"), py::arg("parts"), py::arg("priority"), py::arg("outcomes") = std::nullopt, release())
      .def(
          "kept",
          [](PyClient& c, uint64_t key) {
            bps::python::KeptRound k = c.get().kept(key);
            return std::make_tuple(k.completed, k.whole, k.pushOffset);
          },
          py::arg("key"), release())
      .def("kept_bytes", [](PyClient& c, uint64_t key) { return c.get().keptBytes(key); }, py::arg("key"), release())
      .def("abandon", [](PyClient& c, size_t server, const std::string& why) { c.get().abandon(server, why); },
           py::arg("server"), py::arg("why"), release())
      .def("take_behind", [](PyClient& c) { return c.get().takeBehind(); })
      .def("scheduler_stats",
           [](PyClient& c) {
             bps::python::SchedulerStats s = c.get().schedulerStats();
             return py::dict(py::arg("credit_bytes") = s.creditBytes, py::arg("credit_in_flight") = s.creditInFlight,
                             py::arg("peak_credit_in_flight") = s.peakCreditInFlight, py::arg("queued") = s.queued,
                             py::arg("push_bytes_in_flight") = s.pushBytesInFlight,
                             py::arg("peak_push_bytes_in_flight") = s.peakPushBytesInFlight,
                             py::arg("parts_sent") = s.partsSent, py::arg("parts_acknowledged") = s.partsAcknowledged,
                             py::arg("server_credit_bytes") = s.serverCreditBytes,
                             py::arg("peak_server_credit_in_flight") = s.peakServerCreditInFlight,
                             py::arg("peak_server_push_bytes_in_flight") = s.peakServerPushBytesInFlight,
                             py::arg("io_wakeups") = s.ioWakeups);
           })
      .def(
          "stats",
          [](PyClient& c, uint64_t token, size_t server, const at::Tensor& dst) {
            c.get().stats(token, server, dst.detach());
          },
          py::arg("token"), py::arg("server"), py::arg("dst"), release())
      .def("incarnations", [](PyClient& c) { return c.get().incarnations(); }, release())
      .def("bytes_sent", [](PyClient& c) { return c.get().bytesSent(); }, release())
      .def("bytes_received", [](PyClient& c) { return c.get().bytesReceived(); }, release())
      .def("stream_ready", [](PyClient& c, size_t server) { return c.get().streamReady(server); }, py::arg("server"),
           release())
      .def("stream_local", [](PyClient& c, size_t server) { return c.get().streamLocal(server); }, py::arg("server"),
           release())
      .def("stream_shared", [](PyClient& c, size_t server) { return c.get().streamShared(server); },
           py::arg("server"), release())
      .def("stream_shared_bytes", [](PyClient& c) { return c.get().streamSharedBytes(); }, release())
      .def("stream_bytes_sent", [](PyClient& c) { return c.get().streamBytesSent(); }, release())
      .def("stream_bytes_received", [](PyClient& c) { return c.get().streamBytesReceived(); }, release())
      .def("completion_threads_peak", [](PyClient& c) { return c.get().completionThreadsPeak(); }, release())
      .def("post", &PyClient::post, py::arg("fn"))
      .def(
          "trace",
          [](PyClient& c, size_t capacity) {
            uint64_t dropped = 0;
            at::Tensor events = c.get().trace().take(capacity, &dropped);
            return std::make_tuple(events, dropped);
          },
          "(events [n, 8] int64, dropped) recorded since the last call; record up to `capacity` more (0: stop). "
          "See cpp_ext/common/trace.h.",
          py::arg("capacity"), release())
      .def("close", [](PyClient& c) { c.get().close(); }, release());

  // The summation server's native core (cpp_ext/server/), bound in server_bindings.cpp.
  bps::python::bindServerCore(m);
  py::module_ testing = m.def_submodule("_testing", "What only the tests call (cpp_ext/python/testing.cpp).");
  bps::python::bindTesting(testing);
}
