// TCP transport: client streams to one peer (Peer) and the serving side of a data connection
// (serve_connection). Each stream pipelines requests; the server answers in order.
#pragma once

#include <deque>
#include <thread>

#include "aead.h"
#include "common.h"
#include "grants.h"

namespace kvt {

// std::allocator whose value-initialisation does nothing: resizing a byte buffer that is about to
// be overwritten should not write it twice.
template <typename T>
struct UninitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  UninitAllocator() = default;
  template <typename U>
  UninitAllocator(const UninitAllocator<U>&) {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

// One TCP connection to a peer: request batches go out with one writev (from the caller's thread
// when the stream is idle, else from a sender thread); a receiver thread, always parked in recv(),
// matches responses to in-flight requests in FIFO order.
class Stream {
 public:
  Stream(int fd, uint64_t stall_ms, Counters* counters, const WireKeys& keys);
  ~Stream();
  // Queue requests; a small batch on an idle stream is written by the calling thread at once.
  bool enqueue(std::vector<SubReq>& reqs);  // false when the stream is broken
  uint64_t queued_bytes() const { return queued_.load(std::memory_order_relaxed); }
  bool broken() const;
  void shutdown();
  uint64_t bytes_moved() const { return moved_.load(std::memory_order_relaxed); }

 private:
  void send_loop();
  void send_batch(std::vector<SubReq>& batch);  // caller holds send_mu_
  void send_guarded(std::vector<SubReq>& batch);  // send_batch; a throw breaks the stream, never the process
  void send_sealed(std::vector<SubReq>& batch);  // send_batch on an encrypted stream
  void recv_loop();
  int32_t recv_frames();
  bool stalled();
  bool next_is_large_read();
  void fail(std::deque<SubReq>& reqs, int32_t status);
  void finish(SubReq& r, int32_t status);
  void mark_broken(int32_t status);

  int fd_;
  uint64_t stall_ms_;
  Counters* counters_;
  std::mutex send_mu_;  // serialises writers so in_flight_ order is wire order
  mutable std::mutex mu_;
  std::condition_variable send_cv_;
  std::deque<SubReq> to_send_, in_flight_;
  bool broken_ = false, closing_ = false;
  int32_t broken_status_ = kOk;
  std::atomic<uint64_t> queued_{0};
  std::chrono::steady_clock::time_point activity_;  // last send into an empty pipe or response
  std::unique_ptr<Aead> tx_, rx_;  // null: plaintext stream
  // Ciphertext staging (tx under send_mu_, rx receiver only); growing it leaves bytes uninitialised.
  std::vector<uint8_t, UninitAllocator<uint8_t>> sealed_out_, sealed_in_;
  std::atomic<uint64_t> moved_{0};  // payload bytes this stream carried
  std::thread sender_, receiver_;
};

// All streams to one peer. Large ops are striped across streams; every piece goes to the
// stream with the fewest queued bytes.
class Peer {
 public:
  // keys: one WireKeys per fd, or empty for plaintext streams.
  Peer(const std::vector<int>& fds, const std::vector<WireKeys>& keys, uint64_t stall_ms, uint64_t stripe_bytes,
       Counters* counters);
  // Split `reqs` (one per op, `op` set) into pieces and spread them over the streams.
  void dispatch(std::vector<SubReq>& reqs);
  bool alive() const;
  void shutdown();
  std::vector<uint64_t> stream_bytes() const;

 private:
  std::vector<std::unique_ptr<Stream>> streams_;
  uint64_t stripe_bytes_;
};

// Serves one authenticated data connection until it closes; bounds-checks every op against the
// regions this engine exports, and every write into a "granted" region against `grants` (the
// grants of the peer this connection authenticated as; null: none). Bounce buffers (file regions,
// encrypted streams) come out of `budget`.
void serve_connection(int fd, const WireKeys& keys, const RegionTable& regions, uint64_t stall_ms,
                      Counters* counters, BounceBudget* budget, const std::atomic<bool>& closing,
                      GrantSet* grants = nullptr);

}  // namespace kvt
