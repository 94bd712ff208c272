#include "digest.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <new>
#include <type_traits>

namespace kvt {

namespace {

// The slice of libxxhash's ABI used here (xxhash.h 0.8: XXH64_hash_t is uint64_t, XXH_errorcode an
// int enum, XXH3_state_t opaque behind create/free).
struct XxhApi {
  void* (*create_state)() = nullptr;
  int (*free_state)(void*) = nullptr;
  int (*reset_with_seed)(void*, uint64_t) = nullptr;
  int (*update)(void*, const void*, size_t) = nullptr;
  uint64_t (*digest)(const void*) = nullptr;
};

XxhApi g_api;
std::atomic<bool> g_loaded{false};
std::mutex g_load_mu;

}  // namespace

bool digest_load(const std::string& path, std::string* err) {
  std::lock_guard<std::mutex> lock(g_load_mu);
  if (g_loaded.load()) return true;
  void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);  // already loaded by python-xxhash: same copy
  if (!lib) {
    *err = std::string("dlopen ") + path + ": " + ::dlerror();
    return false;
  }
  XxhApi api;
  std::string missing;
  // python-xxhash builds with runtime CPU dispatch: the *_dispatch entry points pick the widest
  // vector unit (what its own calls use); plain builds export only the generic names.
  auto sym = [&](auto& fn, const char* dispatched, const char* plain) {
    using Fn = std::remove_reference_t<decltype(fn)>;
    fn = dispatched ? reinterpret_cast<Fn>(::dlsym(lib, dispatched)) : nullptr;
    if (!fn) fn = reinterpret_cast<Fn>(::dlsym(lib, plain));
    if (!fn) missing += std::string(missing.empty() ? "" : ", ") + plain;
  };
  sym(api.create_state, nullptr, "XXH3_createState");
  sym(api.free_state, nullptr, "XXH3_freeState");
  sym(api.reset_with_seed, "XXH3_64bits_reset_withSeed_dispatch", "XXH3_64bits_reset_withSeed");
  sym(api.update, "XXH3_64bits_update_dispatch", "XXH3_64bits_update");
  sym(api.digest, nullptr, "XXH3_64bits_digest");
  if (!missing.empty()) {
    *err = path + " lacks " + missing;
    return false;
  }
  g_api = api;
  g_loaded.store(true);
  return true;
}

bool digest_loaded() { return g_loaded.load(); }

Xxh3::Xxh3(uint64_t seed) : state_(g_api.create_state()) {
  if (!state_) throw std::bad_alloc();
  g_api.reset_with_seed(state_, seed);
}

Xxh3::~Xxh3() { g_api.free_state(state_); }

void Xxh3::update(const void* data, size_t len) { g_api.update(state_, data, len); }

uint64_t Xxh3::digest() const { return g_api.digest(state_); }

}  // namespace kvt
