// See future_work.h.
#include "python/future_work.h"

#include <ATen/core/ivalue.h>
#include <pybind11/pybind11.h>

#include "common/errors.h"

#include <optional>
#include <utility>

namespace bps::python {

FutureWork::FutureWork(c10::intrusive_ptr<c10::ivalue::Future> future, std::chrono::milliseconds timeout,
                       std::string what, TimeoutError makeTimeoutError, Taken taken)
    : future_(std::move(future)),
      timeout_(timeout),
      what_(std::move(what)),
      makeTimeoutError_(std::move(makeTimeoutError)),
      taken_(std::move(taken)) {
  future_->addCallback([done = done_](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(done->mutex);
    done->done = true;
    done->cv.notify_all();
  });
}

c10::intrusive_ptr<c10::ivalue::Future> FutureWork::getFuture() {
  if (taken_ && PyGILState_Check() != 0) {  // two Python threads hold the GIL in turn: it runs once
    Taken taken = std::move(taken_);
    taken_ = nullptr;
    taken();
  }
  return future_;
}

bool FutureWork::isCompleted() { return future_->completed(); }

bool FutureWork::isSuccess() const { return future_->completed() && !future_->hasError(); }

std::exception_ptr FutureWork::exception() const {
  return future_->completed() && future_->hasError() ? future_->exception_ptr() : nullptr;
}

std::vector<at::Tensor> FutureWork::result() {
  wait();
  const c10::IValue& value = future_->constValue();
  if (value.isPyObject()) return value.toPyObjectHolder()->extractTensors();
  if (value.isTensorList()) return value.toTensorVector();
  if (value.isTensor()) return {value.toTensor()};
  return {};
}

void FutureWork::synchronize() {
  // torch's Python binding calls this with the GIL held, and the completion that ends the wait needs it.
  std::optional<pybind11::gil_scoped_release> release;
  if (PyGILState_Check() != 0) release.emplace();
  wait();
}

bool FutureWork::wait(std::chrono::milliseconds timeout) {
  auto limit = timeout == kNoTimeout ? timeout_ : timeout;
  {
    std::unique_lock<std::mutex> lock(done_->mutex);
    if (!done_->cv.wait_for(lock, limit, [this] { return done_->done; })) {
      // torch's backends' words ("Timed out"), which code and torch's own tests match.
      std::string message =
          formatText("torch_bps: Timed out after %g s waiting for ", limit.count() / 1000.0) + what_ + " to complete";
      std::rethrow_exception(makeTimeoutError_(message));
    }
  }
  future_->wait();  // returns at once; for device futures it makes the current streams wait for the result
  if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
  return true;
}

}  // namespace bps::python
