// Shared records of the native data plane: status codes, regions, batches, wire headers.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvt {

// Per-op status; mirrored by transfer/errors.py (keep the numbers in step).
enum Status : int32_t {
  kOk = 0,
  kPending = 1,
  kUnknownRegion = 2,
  kOutOfBounds = 3,
  kReadOnly = 4,
  kPeerClosed = 5,
  kTimeout = 6,
  kIoError = 7,
  kClosed = 8,
  kProtocol = 9,
  kInvalid = 10,
  kBusy = 11,  // the serving engine's bounce-buffer budget stayed full for the stall time
  kNotGranted = 12,  // a remote write outside every range the owner granted that peer
};
constexpr int32_t kLastStatus = kNotGranted;

enum Opcode : uint8_t { kRead = 1, kWrite = 2 };

enum class RegionKind : uint8_t { kMemory = 0, kFile = 1 };

// A registered region. Memory regions point into a buffer that Python keeps alive while
// registered; file regions own their descriptors.
struct Region {
  uint64_t id = 0;
  std::atomic<void*> ucx_memh{nullptr};  // set when UCX mapped it (the ucx route); Python unmaps it
  std::atomic<bool> ucx_cuda{false};
  std::atomic<uint8_t*> ucx_base{nullptr};  // what UCX mapped: `base`, or a CUDA region's device memory
  RegionKind kind = RegionKind::kMemory;
  uint8_t* base = nullptr;
  uint64_t size = 0;
  bool readonly = false;
  bool remote_access = false;
  uint8_t remote_writes = 0;  // RemoteWrites (grants.h): who may write it over a data connection
  int fd = -1;         // file regions: buffered descriptor
  int direct_fd = -1;  // file regions: O_DIRECT descriptor, -1 when unsupported

  ~Region();
  bool contains(uint64_t off, uint64_t len) const { return off <= size && len <= size - off; }
};
using RegionPtr = std::shared_ptr<Region>;

class RegionTable {
 public:
  uint64_t add(RegionPtr r);
  RegionPtr get(uint64_t id) const;
  RegionPtr remove(uint64_t id);
  std::vector<RegionPtr> clear();

 private:
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, RegionPtr> regions_;
  uint64_t next_id_ = 1;
};

// Drives ops that complete only when someone progresses them (the ucx route), for a Batch.
class Poller {
 public:
  virtual ~Poller() = default;
  virtual bool poll() = 0;                 // progress once; true when something happened
  virtual bool wait(double timeout_s) = 0;  // progress until the batch is done (or timeout)
  // After failed ops' endpoints were closed: wait until their requests are over (cancelled), so no
  // byte of theirs lands later. False when some are still running at the timeout.
  virtual bool settle(double timeout_s) = 0;
  // The caller gives up on the batch (it timed out): fail what is left as a stall would.
  virtual void abandon() = 0;
};

// Completion state of one submitted batch. An op may be split into parts (stripes); the op is
// done when all parts are, and failed if any part failed (first error wins).
class Batch {
 public:
  explicit Batch(size_t n);
  size_t size() const { return n_; }
  void set_parts(size_t op, uint32_t parts) { parts_[op].store(parts, std::memory_order_relaxed); }
  void part_done(size_t op, int32_t status, uint64_t nbytes);
  bool wait(double timeout_s);
  bool wait_events(double timeout_s);  // wait for part_done calls of other threads only
  bool finished() const { return remaining_.load(std::memory_order_acquire) == 0; }
  long failures() const {  // ops not (yet) done and ok
    long n = 0;
    for (size_t i = 0; i < n_; ++i) n += status(i) != kOk;
    return n;
  }
  bool done() const {  // finished(), after progressing once when ops need progress (ucx)
    if (!finished() && poller_) poller_->poll();
    return finished();
  }
  void set_poller(std::unique_ptr<Poller> poller) { poller_ = std::move(poller); }
  bool settle(double timeout_s) { return !poller_ || poller_->settle(timeout_s); }
  void abandon() {
    if (poller_) poller_->abandon();
  }
  int32_t status(size_t op) const { return status_[op].load(std::memory_order_acquire); }
  uint64_t bytes(size_t op) const { return bytes_[op].load(std::memory_order_acquire); }

 private:
  size_t n_;
  std::unique_ptr<std::atomic<int32_t>[]> status_;
  std::unique_ptr<std::atomic<uint64_t>[]> bytes_;
  std::unique_ptr<std::atomic<uint32_t>[]> parts_;
  std::atomic<size_t> remaining_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::unique_ptr<Poller> poller_;  // set once in submit(), before the batch is handed out
};
using BatchPtr = std::shared_ptr<Batch>;

// One op as Python hands it over. route 0 = both regions are local (memcpy / file I/O / a
// mapped shared-memory region of a same-host peer); otherwise the TCP peer id.
struct OpSpec {
  uint8_t opcode;
  uint32_t route;
  uint64_t local_region, local_off, remote_region, remote_off, len;
};

// One piece of an op travelling over a TCP stream.
struct SubReq {
  BatchPtr batch;
  uint32_t op;
  uint8_t opcode;
  RegionPtr local;
  uint64_t local_off, remote_region, remote_off, len;
};

constexpr int kSpinMicros = 200;  // Batch::wait polls this long before blocking
constexpr uint32_t kMagic = 0x4b565431;  // "KVT1"

#pragma pack(push, 1)
struct ReqHeader {
  uint32_t magic;
  uint8_t opcode;
  uint8_t pad[3];
  uint64_t region, offset, length;
};
struct RespHeader {
  int32_t status;
  uint32_t pad;
  uint64_t length;  // payload bytes that follow (reads that succeeded)
};
#pragma pack(pop)

struct Counters {
  std::atomic<uint64_t> tcp_tx{0}, tcp_rx{0}, local_bytes{0}, file_bytes{0}, ucx_bytes{0}, served_ops{0},
      refused_ops{0};
};

}  // namespace kvt
