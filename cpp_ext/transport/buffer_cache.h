// Recycles libzmq's big receive buffers instead of handing them back to the kernel.
//
// libzmq allocates a fresh buffer for every large incoming message (malloc, which maps fresh pages for
// anything above glibc's mmap threshold) and frees it when the message is closed (unmapping it). Touching
// fresh pages costs several times a memcpy of the same bytes (a page fault per page), so a big pull would pay
// more in page faults than in copying. installBufferCache() points the malloc/realloc/free
// entries of libzmq's own GOT (the libzmq this extension links, never another copy in the process) at
// a cache that keeps a few freed big blocks, already faulted in, for the next message of similar size.
// Small allocations and every other library are untouched. The patch is installed once and stays.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace bps::transport {

struct BufferCacheStats {
  uint64_t hits = 0;         // big allocations served from the cache
  uint64_t misses = 0;       // big allocations that went to malloc
  uint64_t cachedBytes = 0;  // held now, free for reuse
};

// Patch the GOT of the libzmq at `libraryPath` (as the dynamic linker names it, see /proc/self/maps),
// by default the one this extension links. Idempotent per library. Returns an empty string on success,
// else why it could not (ZeroMQ then works as before, only slower for big messages).
std::string installBufferCache(const std::string& libraryPath = "");

// Free every cached block now (the limit stays); the client calls it when its last instance closes.
void releaseCachedBuffers();

BufferCacheStats bufferCacheStats();

}  // namespace bps::transport
