// torch_bps._C._testing: what only the tests (and benchmarks) call. The wire header's pack/unpack for
// tests/transport/test_wire.py, the receive-buffer cache's switch and counters for tests/client/test_client.py,
// the client's scheduling queue and credit sizer alone for tests/client/test_scheduler.py, and one key's native
// rounds alone (KeyRoundsProbe) for tests/server/test_server_rounds.py to compare with the reference KeyRounds.
#include <torch/extension.h>

#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "client/credit_queue.h"
#include "client/credit_sizer.h"
#include "server/codecs.h"
#include "server/rounds.h"
#include "transport/buffer_cache.h"
#include "transport/wire.h"

namespace py = pybind11;

namespace bps::python {

using namespace bps::server;
using namespace bps::transport;

namespace {

// A field's value, or TypeError when it is not an int of the field's width (as struct.pack refuses it).
template <typename T>
T field(const std::string& name, const py::handle& value) {
  if (!py::isinstance<py::int_>(value)) throw py::type_error(name + " is not an int");
  py::int_ big = py::reinterpret_borrow<py::int_>(value);
  if (big < py::int_(0) || big > py::int_(std::numeric_limits<T>::max())) {
    throw py::type_error(name + " is out of range for its " + std::to_string(8 * sizeof(T)) + "-bit field");
  }
  return static_cast<T>(big.cast<uint64_t>());
}

py::bytes packHeaderPy(const py::kwargs& fields) {
  Header h;
  for (auto item : fields) {
    std::string name = py::str(item.first);
    if (name == "command") h.command = field<uint16_t>(name, item.second);
    else if (name == "status") h.status = field<uint16_t>(name, item.second);
    else if (name == "dtype") h.dtype = field<uint16_t>(name, item.second);
    else if (name == "worker") h.worker = field<uint32_t>(name, item.second);
    else if (name == "codec") h.codec = field<uint32_t>(name, item.second);
    else if (name == "wait_ms") h.waitMs = field<uint32_t>(name, item.second);
    else if (name == "mode") h.mode = field<uint32_t>(name, item.second);
    else if (name == "behind") h.behind = field<uint32_t>(name, item.second);
    else if (name == "incarnation") h.incarnation = field<uint64_t>(name, item.second);
    else if (name == "job_id") h.jobId = field<uint64_t>(name, item.second);
    else if (name == "key") h.key = field<uint64_t>(name, item.second);
    else if (name == "round") h.round = field<uint64_t>(name, item.second);
    else if (name == "request_id") h.requestId = field<uint64_t>(name, item.second);
    else if (name == "nbytes") h.nbytes = field<uint64_t>(name, item.second);
    else if (name == "offset") h.offset = field<uint64_t>(name, item.second);
    else if (name == "length") h.length = field<uint64_t>(name, item.second);
    else if (name == "dense_bytes") h.denseBytes = field<uint64_t>(name, item.second);
    else if (name == "num_workers") h.numWorkers = field<uint32_t>(name, item.second);
    else if (name == "backups") h.backups = field<uint32_t>(name, item.second);
    else if (name == "window") h.window = field<uint32_t>(name, item.second);
    else if (name == "stream") h.stream = field<uint32_t>(name, item.second);
    else if (name == "staleness") h.staleness = field<uint64_t>(name, item.second);
    else throw py::type_error("Header has no field " + name);
  }
  uint8_t out[kHeaderSize];
  packHeader(h, out);
  return py::bytes(reinterpret_cast<const char*>(out), kHeaderSize);
}

py::dict unpackHeaderPy(py::bytes data) {
  std::string raw = data;
  Header h = unpackHeader(reinterpret_cast<const uint8_t*>(raw.data()), raw.size());
  py::dict d;
  d["command"] = h.command;
  d["status"] = h.status;
  d["dtype"] = h.dtype;
  d["worker"] = h.worker;
  d["codec"] = h.codec;
  d["wait_ms"] = h.waitMs;
  d["mode"] = h.mode;
  d["behind"] = h.behind;
  d["incarnation"] = h.incarnation;
  d["job_id"] = h.jobId;
  d["key"] = h.key;
  d["round"] = h.round;
  d["request_id"] = h.requestId;
  d["nbytes"] = h.nbytes;
  d["offset"] = h.offset;
  d["length"] = h.length;
  d["dense_bytes"] = h.denseBytes;
  d["num_workers"] = h.numWorkers;
  d["backups"] = h.backups;
  d["window"] = h.window;
  d["stream"] = h.stream;
  d["staleness"] = h.staleness;
  return d;
}

py::tuple answerTuple(Answer& a) {
  std::string data(reinterpret_cast<const char*>(a.data.data()), a.data.size());
  return py::make_tuple(a.pull.header.requestId, a.status,
                        a.status == kOk ? py::object(py::bytes(data)) : py::object(py::str(a.message)),
                        a.status == kOk ? a.pull.header.behind : 0);
}

py::list answerList(std::vector<Answer>& answers) {
  py::list out;
  for (auto& a : answers) out.append(answerTuple(a));
  return out;
}

// One key's rounds alone, with the job it reads: what the reference test drives. Every call returns (status,
// error message, answers): status 0 if the call was accepted; answers are (token, status, result bytes or error
// message, the reply's `behind`), the pulls that freeing a round released included.
class KeyRoundsProbe {
 public:
  KeyRoundsProbe(uint32_t numWorkers, uint32_t mode, uint64_t nbytes, uint16_t dtype, const std::string& name,
                 uint32_t backups, uint32_t window, uint32_t codec, uint64_t denseBytes, uint64_t key,
                 uint64_t staleness)
      : job_(makeJob(numWorkers, backups, window, staleness)),
        rounds_(name, job_, counters_, mode, nbytes, dtype,
                codec ? CodecSpec::fromWord(codec, denseBytes, nbytes, key) : CodecSpec{}) {}

  py::tuple push(uint32_t worker, uint64_t rnd, const std::string& data, uint64_t offset) {
    return call([&] { return rounds_.push(worker, rnd, Message::copyOf(data.data(), data.size()), offset); });
  }
  py::tuple pull(uint32_t worker, uint64_t rnd, uint64_t token, uint64_t offset, uint64_t length, double deadline) {
    Header h;
    h.command = kPull;
    h.worker = worker;
    h.round = rnd;
    h.requestId = token;
    h.offset = offset;
    h.length = length;
    return call([&] {
      Answer answer;
      std::vector<Answer> answers;
      if (rounds_.pull(Pull{"", h}, deadline, &answer)) answers.push_back(std::move(answer));
      return answers;
    });
  }
  py::tuple refuse(uint32_t worker, uint64_t rnd, const std::string& reason) {
    return call([&] { return rounds_.refuse(worker, rnd, reason); });
  }
  py::list failLost() {
    std::vector<Answer> failed = rounds_.failLost();
    for (auto& a : rounds_.takeReleased()) failed.push_back(std::move(a));
    return answerList(failed);
  }
  py::list expire(double now) {
    std::vector<Answer> expired = rounds_.expire(now);
    return answerList(expired);
  }
  void setLost(uint32_t worker, const std::string& how) { job_.setLost(worker, how); }
  uint64_t floor() const { return rounds_.floor(); }
  bool hasWaiting() const { return rounds_.hasWaiting(); }
  uint64_t applied(uint32_t worker) const { return rounds_.applied(worker); }
  uint64_t latePushes() const { return counters_.latePushes; }

 private:
  template <typename F>
  py::tuple call(F&& f) {
    uint16_t status = 0;
    std::string message;
    std::vector<Answer> answers;
    try {
      answers = f();
    } catch (const RoundError& e) {
      status = e.status;
      message = e.message;
    }
    for (auto& a : rounds_.takeReleased()) answers.push_back(std::move(a));
    return py::make_tuple(status, message, answerList(answers));
  }
  static Job makeJob(uint32_t numWorkers, uint32_t backups, uint32_t window, uint64_t staleness) {
    Job job;
    job.staleness = staleness;
    job.numWorkers = numWorkers;
    job.backups = backups;
    job.window = window;
    return job;
  }

  Job job_;
  SumCounters counters_;
  KeyRounds rounds_;
};

// The codec arithmetic alone (server/codecs.h), for tests/server/test_codecs.py.
CodecSpec codecSpec(uint32_t word, uint64_t denseBytes, uint64_t wireBytes, uint64_t key) {
  return CodecSpec::fromWord(word, denseBytes, wireBytes, key);
}

py::tuple codecEncode(uint32_t word, uint64_t denseBytes, uint64_t wireBytes, uint64_t key, uint64_t rnd,
                      const std::string& x) {
  CodecSpec spec = codecSpec(word, denseBytes, wireBytes, key);
  std::vector<float> values(spec.elements);
  if (x.size() != values.size() * 4) throw std::invalid_argument("x must hold the key's elements as fp32");
  std::memcpy(values.data(), x.data(), x.size());
  std::string out(wireBytes, '\0');
  encode(spec, rnd, values.data(), reinterpret_cast<uint8_t*>(out.data()));
  return py::make_tuple(py::bytes(out), py::bytes(reinterpret_cast<const char*>(values.data()), x.size()));
}

float codecTopkThreshold(uint32_t word, uint64_t denseBytes, uint64_t wireBytes, uint64_t rnd, const std::string& x) {
  CodecSpec spec = codecSpec(word, denseBytes, wireBytes, 0);
  if (spec.id != kCodecTopk || !checkDeclaration(spec).empty() || x.size() != spec.elements * 4) {
    throw std::invalid_argument("x must hold a valid top-k key's elements as fp32");
  }
  std::vector<float> values(spec.elements);
  std::memcpy(values.data(), x.data(), x.size());
  return topkThreshold(spec, rnd, values.data());
}

std::vector<uint64_t> randomIndicesPy(uint64_t key, uint64_t rnd, uint64_t n, uint64_t k) {
  std::vector<uint64_t> out(k);
  randomIndices(key, rnd, n, k, out.data());
  return out;
}

}  // namespace

void bindTesting(py::module_& m) {
  m.def("codec_encode", &codecEncode, py::arg("codec"), py::arg("dense_bytes"), py::arg("wire_bytes"), py::arg("key"),
        py::arg("round"), py::arg("x"), "(the encoded bytes, the residual x - decode(them) as fp32 bytes)");
  m.def("codec_topk_threshold", &codecTopkThreshold, py::arg("codec"), py::arg("dense_bytes"), py::arg("wire_bytes"),
        py::arg("round"), py::arg("x"), "top-k's candidate threshold for x (fp32 bytes) in that round");
  m.def("codec_check_declaration",
        [](uint32_t word, uint64_t denseBytes, uint64_t wireBytes) {
          return checkDeclaration(codecSpec(word, denseBytes, wireBytes, 0));
        },
        py::arg("codec"), py::arg("dense_bytes"), py::arg("wire_bytes"));
  m.def("random_indices", &randomIndicesPy, py::arg("key"), py::arg("round"), py::arg("n"), py::arg("k"));
  m.attr("HEADER_SIZE") = kHeaderSize;

  m.def("pack_header", &packHeaderPy,
        "Pack a wire header from keyword fields (named as in torch_bps.wire.Header; the rest 0); TypeError for an "
        "unknown field or a value out of its field's range.");
  m.def("unpack_header", &unpackHeaderPy, "Unpack a wire header into a dict; ProtocolError if malformed.",
        py::arg("data"));

  m.def("install_buffer_cache", &installBufferCache,
        "Recycle the big receive buffers of a loaded libzmq (default: the one this extension links); returns "
        "'' on success, else why not (see cpp_ext/transport/buffer_cache.h).",
        py::arg("library_path") = "");
  m.def("buffer_cache_stats", [] {
    BufferCacheStats s = bufferCacheStats();
    return py::dict(py::arg("hits") = s.hits, py::arg("misses") = s.misses, py::arg("cached_bytes") = s.cachedBytes);
  });

  // The client's scheduling queue alone, for tests/client/test_scheduler.py to compare with CreditScheduler.
  using CreditQueue = client::CreditQueue<uint64_t>;
  py::class_<CreditQueue>(m, "CreditQueue")
      .def(py::init<int64_t, int64_t>(), py::arg("credit_bytes"), py::arg("destination_credit_bytes") = 0)
      .def("push", &CreditQueue::push, py::arg("destination"), py::arg("nbytes"), py::arg("priority"), py::arg("item"))
      .def("pop", &CreditQueue::pop,
           "(item, nbytes, destination) with its credit taken, or None if nothing may go yet")
      .def("release", &CreditQueue::release, py::arg("destination"), py::arg("nbytes"))
      .def("destination_in_flight", &CreditQueue::destinationInFlight, py::arg("destination"))
      .def_property_readonly("in_flight", &CreditQueue::inFlight)
      .def_property_readonly("peak_in_flight", &CreditQueue::peakInFlight)
      .def_property_readonly("peak_destination_in_flight", &CreditQueue::peakDestinationInFlight);

  // The automatic credit's rule alone (credit_sizer.h), fed made-up acknowledgements by tests/client/test_scheduler.py.
  py::class_<client::CreditSizer>(m, "CreditSizer")
      .def(py::init<int64_t, int64_t, double, double, size_t>(), py::arg("min_bytes"), py::arg("max_bytes"),
           py::arg("jitter_seconds"), py::arg("window_seconds") = 0.05, py::arg("windows") = 20)
      .def("on_ack", &client::CreditSizer::onAck, py::arg("destination"), py::arg("nbytes"), py::arg("now"),
           py::arg("backlogged"), "the new credit when a measured window closed, else 0");

  py::class_<KeyRoundsProbe>(m, "KeyRoundsProbe")
      .def(py::init<uint32_t, uint32_t, uint64_t, uint16_t, const std::string&, uint32_t, uint32_t, uint32_t, uint64_t,
                    uint64_t, uint64_t>(),
           py::arg("num_workers"), py::arg("mode"), py::arg("nbytes"), py::arg("dtype"), py::arg("name"),
           py::arg("backups") = 0, py::arg("window") = 2, py::arg("codec") = 0, py::arg("dense_bytes") = 0,
           py::arg("key") = 0, py::arg("staleness") = 0)
      .def("push", &KeyRoundsProbe::push, py::arg("worker"), py::arg("round"), py::arg("data"), py::arg("offset"))
      .def("pull", &KeyRoundsProbe::pull, py::arg("worker"), py::arg("round"), py::arg("token"), py::arg("offset"),
           py::arg("length"), py::arg("deadline") = std::numeric_limits<double>::infinity())
      .def("refuse", &KeyRoundsProbe::refuse, py::arg("worker"), py::arg("round"), py::arg("reason"))
      .def("fail_lost", &KeyRoundsProbe::failLost)
      .def("expire", &KeyRoundsProbe::expire, py::arg("now"))
      .def("set_lost", &KeyRoundsProbe::setLost, py::arg("worker"), py::arg("how"))
      .def_property_readonly("floor", &KeyRoundsProbe::floor)
      .def("applied", &KeyRoundsProbe::applied, py::arg("worker"))
      .def_property_readonly("has_waiting", &KeyRoundsProbe::hasWaiting)
      .def_property_readonly("late_pushes", &KeyRoundsProbe::latePushes);
}

}  // namespace bps::python
