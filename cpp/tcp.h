// TCP transport: client streams to one peer (Peer) and the serving side of a data connection
// (serve_connection). Each stream pipelines requests; the server answers in order.
#pragma once

#include <deque>
#include <thread>

#include "common.h"

namespace kvt {

// One TCP connection to a peer: a sender thread writes request batches with one writev, a
// receiver thread matches responses to in-flight requests in FIFO order.
class Stream {
 public:
  Stream(int fd, uint64_t stall_ms, Counters* counters);
  ~Stream();
  bool enqueue(std::vector<SubReq>& reqs);  // false when the stream is broken
  uint64_t queued_bytes() const { return queued_.load(std::memory_order_relaxed); }
  bool broken() const;
  void shutdown();

 private:
  void send_loop();
  void recv_loop();
  void fail(std::deque<SubReq>& reqs, int32_t status);
  void finish(SubReq& r, int32_t status);
  void mark_broken(int32_t status);

  int fd_;
  uint64_t stall_ms_;
  Counters* counters_;
  mutable std::mutex mu_;
  std::condition_variable send_cv_, recv_cv_;
  std::deque<SubReq> to_send_, in_flight_;
  bool broken_ = false, closing_ = false;
  int32_t broken_status_ = kOk;
  std::atomic<uint64_t> queued_{0};
  std::thread sender_, receiver_;
};

// All streams to one peer. Large ops are striped across streams; every piece goes to the
// stream with the fewest queued bytes.
class Peer {
 public:
  Peer(const std::vector<int>& fds, uint64_t stall_ms, uint64_t stripe_bytes, Counters* counters);
  void dispatch(const BatchPtr& batch, uint32_t op, uint8_t opcode, const RegionPtr& local,
                uint64_t local_off, uint64_t remote_region, uint64_t remote_off, uint64_t len);
  bool alive() const;
  void shutdown();

 private:
  Stream& least_loaded();
  std::vector<std::unique_ptr<Stream>> streams_;
  uint64_t stripe_bytes_;
};

// Serves one authenticated data connection until it closes; bounds-checks every op against the
// regions this engine exports.
void serve_connection(int fd, const RegionTable& regions, uint64_t stall_ms, Counters* counters,
                      const std::atomic<bool>& closing);

}  // namespace kvt
