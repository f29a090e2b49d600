// See op.h.
#include "client/op.h"

#include <cinttypes>

namespace bps::client {

std::string describe(const Op& op, const ClientOptions& options) {
  if (op.kind != transport::kPush) {
    return formatText("job 0x%016" PRIx64 ", worker %u of %u", options.jobId, options.worker, options.numWorkers);
  }
  return formatText("job 0x%016" PRIx64 ", key %" PRIu64 ", round %" PRIu64 ", worker %u of %u", options.jobId, op.key,
                    op.round, options.worker, options.numWorkers);
}

}  // namespace bps::client
