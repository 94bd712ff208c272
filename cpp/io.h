// Blocking socket and file I/O with stall timeouts (sockets carry SO_RCVTIMEO/SO_SNDTIMEO, so a
// call that makes no progress for the stall time returns kTimeout instead of hanging).
#pragma once

#include <sys/uio.h>

#include <array>
#include <deque>
#include <memory>
#include <vector>

#include "aead.h"
#include "common.h"

namespace kvt {

// A 4 KiB-aligned heap buffer: file bounces through it can use O_DIRECT.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t n);
  AlignedBuffer(AlignedBuffer&& other) noexcept : data_(other.data_), size_(other.size_) { other.data_ = nullptr; }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  uint8_t* data_;
  size_t size_;
};

void set_stream_options(int fd, uint64_t stall_ms);
int32_t send_all(int fd, const void* data, size_t n);
int32_t writev_all(int fd, std::vector<iovec>& iov);
int32_t recv_exact(int fd, void* dst, size_t n);

// Copy between a region and plain memory, whatever the region's kind.
int32_t region_read(const Region& r, uint64_t off, void* dst, uint64_t len);
int32_t region_write(Region& r, uint64_t off, const void* src, uint64_t len);

// Buffered reader: small messages come out of one recv; large payloads go straight into the
// destination memory.
class Reader {
 public:
  explicit Reader(int fd) : fd_(fd), buf_(256 * 1024) {}
  size_t buffered() const { return tail_ - head_; }
  int32_t read(void* dst, size_t n);
  int32_t discard(size_t n);
  int32_t read_into_region(Region& r, uint64_t off, uint64_t len);
  // One recv() of what is available, at most `limit` bytes (kTimeout after the stall time). A small
  // limit before a large payload keeps that payload out of the bounce buffer.
  int32_t fill(size_t limit = kDefaultFill);
  static constexpr size_t kDefaultFill = 64 * 1024;

 private:
  int fd_;
  std::vector<uint8_t> buf_;
  size_t head_ = 0, tail_ = 0;
};

// Gathers response headers and payloads and sends them with one writev.
class Writer {
 public:
  explicit Writer(int fd) : fd_(fd) {}
  void header(const RespHeader& h);
  void payload(const void* p, size_t n, RegionPtr pin);
  void owned_payload(AlignedBuffer&& bytes, std::unique_ptr<BudgetHold> hold = nullptr);
  void raw(const void* p, size_t n);  // a small sealed header (copied; at most 64 bytes)
  size_t pending_bytes() const { return pending_; }
  size_t pending_iov() const { return iov_.size(); }
  int32_t flush();

 private:
  int fd_;
  std::deque<RespHeader> headers_;  // deque: stable addresses for the iovecs
  std::deque<AlignedBuffer> owned_;
  std::deque<std::array<uint8_t, 64>> raw_;
  std::vector<std::unique_ptr<BudgetHold>> holds_;  // budget of owned_ buffers, released on flush
  std::vector<iovec> iov_;
  std::vector<RegionPtr> pins_;
  size_t pending_ = 0;
};

}  // namespace kvt
