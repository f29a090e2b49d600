// FutureWork: the c10d::Work the "byteps" backend and bps_hook hand to torch for every collective.
//
// torch's C++ consumers (DDP's reducer, Join) call getFuture() and read the future's value or error in C++,
// so the future must be failed with c10::ivalue::Future::setError, never with a Python exception stored
// as its value. torch's own FutureWrappingWork would do for getFuture(), but its wait() returns true on a
// failed future and takes no timeout: this one rethrows the failure and honours the timeout.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace bps::python {

class FutureWork : public c10d::Work {
 public:
  // Builds the error wait() throws when `timeout` passes (module.cpp makes it a BpsTimeoutError).
  using TimeoutError = std::function<std::exception_ptr(const std::string& message)>;
  // Called once, with the GIL held, the first time Python takes the future (see getFuture).
  using Taken = std::function<void()>;

  // `timeout` applies to wait() without one; `what` names the collective in the timeout's message.
  FutureWork(c10::intrusive_ptr<c10::ivalue::Future> future, std::chrono::milliseconds timeout, std::string what,
             TimeoutError makeTimeoutError, Taken taken = nullptr);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  // Blocks until the future completes or the timeout passes; rethrows the collective's own error.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  // The caller's current streams wait for the work (on the devices of a device future): c10d's contract, which
  // NCCL keeps without a host wait. Completion here is on the host, so this waits for it first, as wait() does.
  void synchronize() override;
  // Taken from Python (`work.get_future()`: the GIL held), `taken` runs first: that caller may attach callbacks that
  // launch collectives (PowerSGD), which the launch order waits for. DDP's reducer takes it from C++, GIL released.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // A per-call timeout (a collective's opts.timeout): set before the Work is handed out.
  void setTimeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

 private:
  // Signalled by a callback on the future: c10::ivalue::Future has no timed wait.
  struct Done {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
  };

  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::chrono::milliseconds timeout_;
  std::string what_;
  TimeoutError makeTimeoutError_;
  Taken taken_;
  std::shared_ptr<Done> done_ = std::make_shared<Done>();
};

}  // namespace bps::python
