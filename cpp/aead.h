// Per-frame authenticated encryption of TCP data streams (AES-256-GCM, one key per direction,
// a 96-bit counter nonce per message), and the engine-wide cap on bounce-buffer memory.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>

namespace kvt {

constexpr size_t kTagBytes = 16;
constexpr size_t kKeyBytes = 32;

// One direction of a connection. A message is sealed or opened once; the counter never repeats
// under a key, and a forged, replayed, reordered or dropped message fails `open`.
class Aead {
 public:
  explicit Aead(const uint8_t key[kKeyBytes]);
  ~Aead();
  Aead(const Aead&) = delete;
  Aead& operator=(const Aead&) = delete;
  // out may equal in. Writes kTagBytes of tag.
  bool seal(const uint8_t* in, size_t n, uint8_t* out, uint8_t* tag);
  // false: the message was not sent by the holder of the key (nothing in `out` may be used).
  bool open(const uint8_t* in, size_t n, uint8_t* out, const uint8_t* tag);
  void skip() { ++counter_; }  // a message consumed unread (a refused write's payload)

 private:
  void* ctx_;  // EVP_CIPHER_CTX, kept opaque so OpenSSL headers stay in aead.cpp
  uint64_t counter_ = 0;
  bool encrypt_;
  bool ready_ = false;
  uint8_t key_[kKeyBytes];
};

// Both directions' keys for a connection: empty = plaintext (trusted network, opt-in).
struct WireKeys {
  std::string tx, rx;
  bool enabled() const { return tx.size() == kKeyBytes && rx.size() == kKeyBytes; }
};

// Caps the bytes of bounce buffers the serving side holds at once, whatever peers ask for.
class BounceBudget {
 public:
  explicit BounceBudget(uint64_t limit) : limit_(limit) {}
  // Waits up to `wait` for room; false if there is none by then (or n exceeds the whole budget).
  bool acquire(uint64_t n, std::chrono::milliseconds wait);
  void release(uint64_t n);
  uint64_t used() const;
  uint64_t limit() const { return limit_; }

 private:
  uint64_t limit_;
  uint64_t used_ = 0;
  mutable std::mutex mu_;
  std::condition_variable cv_;
};

// Holds n bytes of a budget for its lifetime.
class BudgetHold {
 public:
  BudgetHold(BounceBudget* b, uint64_t n) : budget_(b), n_(n) {}
  ~BudgetHold() {
    if (budget_ && n_) budget_->release(n_);
  }
  BudgetHold(const BudgetHold&) = delete;
  BudgetHold& operator=(const BudgetHold&) = delete;

 private:
  BounceBudget* budget_;
  uint64_t n_;
};

}  // namespace kvt
