// See buffer_cache.h.
#include "transport/buffer_cache.h"

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zmq.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

namespace bps::transport {
namespace {

constexpr size_t kBigBlock = 1 << 20;  // below this, glibc reuses memory well by itself
constexpr size_t kMaxLiveTracked = 64;  // big blocks handed out at once; more go straight to malloc

struct Block {
  void* ptr;
  size_t capacity;
};

// Everything below is reached from inside malloc/free of libzmq's threads: it must not allocate through
// the patched entries (it does not: std::vector and friends live in this library, not in libzmq).
// At most this many bytes of freed blocks are kept.
constexpr size_t kCacheLimit = size_t(512) << 20;

struct Cache {
  std::mutex mutex;
  std::vector<Block> live;  // handed out by cachedMalloc, not yet freed
  std::vector<Block> free;  // freed, kept for reuse; most recent last
  size_t freeBytes = 0;
  std::atomic<size_t> liveCount{0};
  BufferCacheStats stats;
};

Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: libzmq may free a block during process exit
  return *c;
}

void* cachedMalloc(size_t n) {
  if (n < kBigBlock) return std::malloc(n);
  Cache& c = cache();
  std::unique_lock<std::mutex> lock(c.mutex);
  if (c.live.size() >= kMaxLiveTracked) {
    lock.unlock();
    return std::malloc(n);
  }
  // Take the smallest cached block that fits and wastes at most a quarter of itself.
  size_t best = c.free.size();
  for (size_t i = 0; i < c.free.size(); ++i) {
    const Block& b = c.free[i];
    if (b.capacity >= n && b.capacity - n <= b.capacity / 4 &&
        (best == c.free.size() || b.capacity < c.free[best].capacity)) {
      best = i;
    }
  }
  Block block{nullptr, n};
  if (best != c.free.size()) {
    block = c.free[best];
    c.free.erase(c.free.begin() + best);
    c.freeBytes -= block.capacity;
    ++c.stats.hits;
  } else {
    ++c.stats.misses;
    lock.unlock();  // malloc of a big block maps pages: not under the lock
    block.ptr = std::malloc(n);
    if (block.ptr == nullptr) return nullptr;
    lock.lock();
  }
  c.live.push_back(block);
  c.liveCount.store(c.live.size(), std::memory_order_release);
  return block.ptr;
}

// Remove p from the live list; returns its capacity, or 0 if p is not ours.
size_t untrack(Cache& c, void* p) {
  for (size_t i = 0; i < c.live.size(); ++i) {
    if (c.live[i].ptr == p) {
      size_t capacity = c.live[i].capacity;
      c.live[i] = c.live.back();
      c.live.pop_back();
      c.liveCount.store(c.live.size(), std::memory_order_release);
      return capacity;
    }
  }
  return 0;
}

void cachedFree(void* p) {
  if (p == nullptr) return;
  Cache& c = cache();
  if (c.liveCount.load(std::memory_order_acquire) == 0) return std::free(p);
  std::vector<void*> release;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    size_t capacity = untrack(c, p);
    if (capacity != 0 && capacity <= kCacheLimit) {
      // Keep it; evict the oldest blocks past the limit.
      c.free.push_back({p, capacity});
      c.freeBytes += capacity;
      p = nullptr;
      while (c.freeBytes > kCacheLimit) {
        release.push_back(c.free.front().ptr);
        c.freeBytes -= c.free.front().capacity;
        c.free.erase(c.free.begin());
      }
    }
  }
  if (p != nullptr) std::free(p);
  for (void* r : release) std::free(r);
}

void* cachedRealloc(void* p, size_t n) {
  if (p == nullptr) return cachedMalloc(n);
  Cache& c = cache();
  size_t capacity = 0;
  if (c.liveCount.load(std::memory_order_acquire) != 0) {
    std::lock_guard<std::mutex> lock(c.mutex);
    for (const Block& b : c.live) {
      if (b.ptr == p) capacity = b.capacity;
    }
  }
  if (capacity == 0) return std::realloc(p, n);  // not ours
  if (n <= capacity) return p;
  void* q = cachedMalloc(n);
  if (q == nullptr) return nullptr;
  std::memcpy(q, p, capacity);
  cachedFree(p);
  return q;
}

struct Patch {
  std::string libraryPath;
  int patched = 0;
  std::string error;
};

// The path with symlinks resolved: the loader names a library by the path it opened, /proc by its target.
std::string canonical(const std::string& path) {
  char* resolved = realpath(path.c_str(), nullptr);
  if (resolved == nullptr) return path;
  std::string out(resolved);
  std::free(resolved);
  return out;
}

bool isInside(const dl_phdr_info* info, uintptr_t address) {
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    uintptr_t start = info->dlpi_addr + ph.p_vaddr;
    if (ph.p_type == PT_LOAD && address >= start && address < start + ph.p_memsz) return true;
  }
  return false;
}

void writeSlot(void** slot, void* value) {
  long page = sysconf(_SC_PAGESIZE);
  auto start = reinterpret_cast<uintptr_t>(slot) & ~static_cast<uintptr_t>(page - 1);
  // RELRO may have made the GOT read-only: open it for this one word. Writing an aligned pointer is
  // atomic, so a libzmq thread calling malloc meanwhile gets the old or the new function, both fine.
  mprotect(reinterpret_cast<void*>(start), page, PROT_READ | PROT_WRITE);
  *slot = value;
}

int patchObject(dl_phdr_info* info, size_t, void* data) {
  auto* patch = static_cast<Patch*>(data);
  if (info->dlpi_name == nullptr || info->dlpi_name[0] == '\0' || canonical(info->dlpi_name) != patch->libraryPath) {
    return 0;
  }
  const ElfW(Dyn)* dynamic = nullptr;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if (info->dlpi_phdr[i].p_type == PT_DYNAMIC) {
      dynamic = reinterpret_cast<const ElfW(Dyn)*>(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    }
  }
  if (dynamic == nullptr) return (patch->error = "libzmq has no dynamic section", 1);
  uintptr_t symtab = 0, strtab = 0, jmprel = 0, rela = 0;
  size_t jmprelSize = 0, relaSize = 0;
  for (const ElfW(Dyn)* d = dynamic; d->d_tag != DT_NULL; ++d) {
    // glibc relocates these in place; an unrelocated (small) value is an offset from the load address.
    uintptr_t value = d->d_un.d_ptr;
    uintptr_t address = isInside(info, value) ? value : info->dlpi_addr + value;
    switch (d->d_tag) {
      case DT_SYMTAB: symtab = address; break;
      case DT_STRTAB: strtab = address; break;
      case DT_JMPREL: jmprel = address; break;
      case DT_RELA: rela = address; break;
      case DT_PLTRELSZ: jmprelSize = d->d_un.d_val; break;
      case DT_RELASZ: relaSize = d->d_un.d_val; break;
    }
  }
  if (symtab == 0 || strtab == 0) return (patch->error = "libzmq has no symbol table", 1);
  const auto* symbols = reinterpret_cast<const ElfW(Sym)*>(symtab);
  const char* names = reinterpret_cast<const char*>(strtab);
  for (auto [table, size] : {std::pair{jmprel, jmprelSize}, std::pair{rela, relaSize}}) {
    const auto* relocs = reinterpret_cast<const ElfW(Rela)*>(table);
    for (size_t i = 0; table != 0 && i < size / sizeof(ElfW(Rela)); ++i) {
      auto type = ELF64_R_TYPE(relocs[i].r_info);
      if (type != R_X86_64_JUMP_SLOT && type != R_X86_64_GLOB_DAT) continue;
      const char* name = names + symbols[ELF64_R_SYM(relocs[i].r_info)].st_name;
      void* replacement = std::strcmp(name, "malloc") == 0    ? reinterpret_cast<void*>(&cachedMalloc)
                          : std::strcmp(name, "free") == 0    ? reinterpret_cast<void*>(&cachedFree)
                          : std::strcmp(name, "realloc") == 0 ? reinterpret_cast<void*>(&cachedRealloc)
                                                              : nullptr;
      if (replacement == nullptr) continue;
      writeSlot(reinterpret_cast<void**>(info->dlpi_addr + relocs[i].r_offset), replacement);
      ++patch->patched;
    }
  }
  return 1;
}

}  // namespace

std::string installBufferCache(const std::string& libraryPath) {
  static std::mutex mutex;
  static std::map<std::string, std::string> results;  // library -> outcome of patching it
  std::lock_guard<std::mutex> lock(mutex);
  Patch patch;
  patch.libraryPath = libraryPath;
  if (patch.libraryPath.empty()) {
    Dl_info where;
    if (dladdr(reinterpret_cast<void*>(&zmq_msg_init_size), &where) == 0 || where.dli_fname == nullptr) {
      return "cannot locate libzmq";
    }
    patch.libraryPath = where.dli_fname;
  }
  patch.libraryPath = canonical(patch.libraryPath);
  auto done = results.find(patch.libraryPath);
  if (done != results.end()) return done->second;
  std::string& result = results[patch.libraryPath];
#if !defined(__x86_64__)
  result = "the buffer cache is implemented for x86_64 only";
#else
  if (dl_iterate_phdr(patchObject, &patch) == 0) {
    result = patch.libraryPath + " is not loaded";
  } else if (!patch.error.empty()) {
    result = patch.error;
  } else if (patch.patched < 2) {
    result = "found no malloc/free imports in " + patch.libraryPath;
  }
#endif
  return result;
}

namespace {

void trimTo(size_t keep) {
  Cache& c = cache();
  std::vector<void*> release;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    while (c.freeBytes > keep) {
      release.push_back(c.free.front().ptr);
      c.freeBytes -= c.free.front().capacity;
      c.free.erase(c.free.begin());
    }
  }
  for (void* r : release) std::free(r);
}

}  // namespace

void releaseCachedBuffers() { trimTo(0); }

BufferCacheStats bufferCacheStats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  BufferCacheStats s = c.stats;
  s.cachedBytes = c.freeBytes;
  return s;
}

}  // namespace bps::transport
