// Why native: python-xxhash holds the GIL while it hashes, so a store node verifying a 32 MiB commit
// (about 2 ms) stalls every other request it serves, and a client cannot hash two blocks at once.
// Here the blocks are hashed with the GIL released, on up to `threads` threads for big batches.
//
// The xxh3 code is python-xxhash's own copy (its extension exports the XXH3_* symbols): loading it
// with dlopen instead of vendoring xxhash keeps one implementation, so a block checksummed by either
// path verifies on the other.
#include "checksum.h"

#include <pybind11/stl.h>

#include "symbols.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace {

using Hash = uint64_t (*)(const void*, size_t, uint64_t);
using CreateState = void* (*)();
using FreeState = int (*)(void*);
using Reset = int (*)(void*, uint64_t);
using Update = int (*)(void*, const void*, size_t);
using Digest = uint64_t (*)(const void*);

struct Xxh3 {
  Hash hash = nullptr;
  CreateState create = nullptr;
  FreeState free = nullptr;
  Reset reset = nullptr;
  Update update = nullptr;
  Digest digest = nullptr;
};

std::mutex g_load_mu;
std::atomic<bool> g_loaded{false};
Xxh3 g_xxh3;

void load(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_load_mu);
  if (g_loaded.load()) return;
  kvt::Symbols lib(path);  // already loaded by Python: the same copy
  Xxh3 api;
  lib.resolve(api.hash, "XXH3_64bits_withSeed");
  lib.resolve(api.create, "XXH3_createState");
  lib.resolve(api.free, "XXH3_freeState");
  lib.resolve(api.reset, "XXH3_64bits_reset_withSeed");
  lib.resolve(api.update, "XXH3_64bits_update");
  lib.resolve(api.digest, "XXH3_64bits_digest");
  if (std::string why = lib.error(); !why.empty()) throw std::runtime_error(why);
  g_xxh3 = api;
  g_loaded.store(true);
}

struct Span {
  const uint8_t* data;
  size_t size;
};

// One block: its seed and its bytes, possibly in several segments taken in order.
struct Block {
  uint64_t seed;
  std::vector<Span> parts;
  size_t bytes = 0;
};

// A streaming state, made only when a block comes in several segments.
class State {
 public:
  ~State() {
    if (state_) g_xxh3.free(state_);
  }
  void* get() {
    if (!state_ && !(state_ = g_xxh3.create())) throw std::bad_alloc();
    return state_;
  }

 private:
  void* state_ = nullptr;
};

uint64_t hash_block(const Block& b, State& state) {
  if (b.parts.size() == 1) return g_xxh3.hash(b.parts[0].data, b.parts[0].size, b.seed);
  void* s = state.get();
  g_xxh3.reset(s, b.seed);
  for (const Span& part : b.parts) g_xxh3.update(s, part.data, part.size);
  return g_xxh3.digest(s);
}

// Holds the buffers' views until the hashing is over (the GIL is released meanwhile).
class Views {
 public:
  ~Views() {
    for (Py_buffer& v : views_) PyBuffer_Release(&v);
  }
  Span add(const py::handle& obj) {
    views_.emplace_back();  // room first: a view taken is always released
    if (PyObject_GetBuffer(obj.ptr(), &views_.back(), PyBUF_SIMPLE) != 0) {  // contiguous only
      views_.pop_back();
      throw py::error_already_set();
    }
    const Py_buffer& view = views_.back();
    return Span{static_cast<const uint8_t*>(view.buf), static_cast<size_t>(view.len)};
  }

 private:
  std::vector<Py_buffer> views_;
};

constexpr size_t kBytesPerThread = 4 << 20;  // below this a thread costs more than it saves
// Below this the GIL stays held: taking it back after a release can cost up to the 5 ms switch
// interval while another thread runs Python, far more than hashing a small block (5 us per 64 KiB).
constexpr size_t kReleaseBytes = 2 << 20;

std::vector<uint64_t> xxh3_many(const py::sequence& blocks, const std::vector<uint64_t>& seeds, int threads) {
  if (!g_loaded.load()) throw std::runtime_error("xxh3_load() first");
  if (static_cast<size_t>(py::len(blocks)) != seeds.size()) throw py::value_error("one seed per block");
  Views views;
  std::vector<Block> work(seeds.size());
  size_t total = 0;
  for (size_t i = 0; i < work.size(); ++i) {
    py::object item = blocks[i];  // owned: a sequence may hand out a fresh object per index
    work[i].seed = seeds[i];
    if (py::isinstance<py::list>(item) || py::isinstance<py::tuple>(item)) {
      for (const py::handle& part : py::reinterpret_borrow<py::sequence>(item)) work[i].parts.push_back(views.add(part));
    } else {
      work[i].parts.push_back(views.add(item));
    }
    for (const Span& s : work[i].parts) work[i].bytes += s.size;
    total += work[i].bytes;
  }
  std::vector<uint64_t> out(work.size());
  if (total < kReleaseBytes) {
    State state;
    for (size_t i = 0; i < work.size(); ++i) out[i] = hash_block(work[i], state);
    return out;
  }
  py::gil_scoped_release nogil;
  size_t n = std::min<size_t>({static_cast<size_t>(std::max(threads, 1)), work.size(), total / kBytesPerThread});
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  auto run = [&] {
    try {
      State state;
      for (size_t i; !failed.load() && (i = next.fetch_add(1)) < work.size();) out[i] = hash_block(work[i], state);
    } catch (const std::bad_alloc&) {
      failed.store(true);
    }
  };
  std::vector<std::thread> pool;
  try {
    pool.reserve(n);
    for (size_t t = 1; t < n; ++t) pool.emplace_back(run);
  } catch (const std::exception&) {
    // no thread to spare: the threads already started and this one do the work
  }
  run();
  for (std::thread& t : pool) t.join();
  if (failed.load()) throw std::bad_alloc();
  return out;
}

}  // namespace

namespace kvt {

void add_checksum(py::module_& m) {
  m.def("xxh3_load", &load, py::arg("library_path"),
        "Resolve xxh3 from a library exporting XXH3_* (python-xxhash's extension); the first load stays.");
  m.def("xxh3_many", &xxh3_many, py::arg("blocks"), py::arg("seeds"), py::arg("threads") = 1,
        "xxh3-64 of each block (a buffer, or a list of buffers hashed in order) with its seed; the "
        "GIL is released and big batches spread over up to `threads` threads.");
}

}  // namespace kvt
