// Streaming xxh3-64 for the digests engine copies take on the way. The calls come from
// python-xxhash's own extension (dlopen of the copy Python already loaded, as cpp/ucx.cpp does with
// libucp): digests equal xxhash.xxh3_64_intdigest's by construction, and the build needs no headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvt {

// Resolve the xxh3 calls from the shared object at `path`; false (and `err`) when it lacks them.
bool digest_load(const std::string& path, std::string* err);
bool digest_loaded();

// Streaming xxh3-64: update() with the bytes in order, then digest(). Needs digest_loaded().
class Xxh3 {
 public:
  explicit Xxh3(uint64_t seed);
  ~Xxh3();
  Xxh3(const Xxh3&) = delete;
  Xxh3& operator=(const Xxh3&) = delete;
  void update(const void* data, size_t len);
  uint64_t digest() const;

 private:
  void* state_;
};

}  // namespace kvt
