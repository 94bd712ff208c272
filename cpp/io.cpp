#include "io.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <new>

namespace kvt {

namespace {

int32_t errno_status(ssize_t r) {
  if (r == 0) return kPeerClosed;
  if (errno == EAGAIN || errno == EWOULDBLOCK) return kTimeout;
  if (errno == ECONNRESET || errno == EPIPE || errno == ENOTCONN || errno == EBADF) return kPeerClosed;
  return kIoError;
}

constexpr uint64_t kDirectAlign = 4096;

bool direct_ok(const Region& r, uint64_t off, const void* mem, uint64_t len) {
  return r.direct_fd >= 0 && off % kDirectAlign == 0 && len % kDirectAlign == 0 &&
         reinterpret_cast<uintptr_t>(mem) % kDirectAlign == 0;
}

}  // namespace

AlignedBuffer::AlignedBuffer(size_t n) : data_(nullptr), size_(n) {
  void* p = nullptr;
  if (::posix_memalign(&p, kDirectAlign, n ? n : 1) != 0) throw std::bad_alloc();
  data_ = static_cast<uint8_t*>(p);
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

void set_stream_options(int fd, uint64_t stall_ms) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  timeval tv{static_cast<time_t>(stall_ms / 1000), static_cast<suseconds_t>((stall_ms % 1000) * 1000)};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

int32_t send_all(int fd, const void* data, size_t n) {
  auto p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    ssize_t r = ::send(fd, p, n, MSG_NOSIGNAL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return errno_status(r);
    p += r;
    n -= static_cast<size_t>(r);
  }
  return kOk;
}

int32_t writev_all(int fd, std::vector<iovec>& iov) {
  size_t i = 0;
  while (i < iov.size()) {
    msghdr msg{};
    msg.msg_iov = &iov[i];
    msg.msg_iovlen = std::min<size_t>(iov.size() - i, IOV_MAX);
    ssize_t r = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return errno_status(r);
    size_t left = static_cast<size_t>(r);
    while (i < iov.size() && left >= iov[i].iov_len) left -= iov[i++].iov_len;
    if (left > 0) {
      iov[i].iov_base = static_cast<uint8_t*>(iov[i].iov_base) + left;
      iov[i].iov_len -= left;
    }
  }
  return kOk;
}

int32_t recv_exact(int fd, void* dst, size_t n) {
  auto p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, MSG_WAITALL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return errno_status(r);
    p += r;
    n -= static_cast<size_t>(r);
  }
  return kOk;
}

int32_t region_read(const Region& r, uint64_t off, void* dst, uint64_t len) {
  if (r.kind == RegionKind::kMemory) {
    std::memcpy(dst, r.base + off, len);
    return kOk;
  }
  int fd = direct_ok(r, off, dst, len) ? r.direct_fd : r.fd;
  auto p = static_cast<uint8_t*>(dst);
  while (len > 0) {
    ssize_t got = ::pread(fd, p, len, static_cast<off_t>(off));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return kIoError;
    if (got == 0) {  // past the written end of a sparse file: zeros, like memory
      std::memset(p, 0, len);
      return kOk;
    }
    p += got;
    off += static_cast<uint64_t>(got);
    len -= static_cast<uint64_t>(got);
  }
  return kOk;
}

int32_t region_write(Region& r, uint64_t off, const void* src, uint64_t len) {
  if (r.kind == RegionKind::kMemory) {
    std::memcpy(r.base + off, src, len);
    return kOk;
  }
  int fd = direct_ok(r, off, src, len) ? r.direct_fd : r.fd;
  auto p = static_cast<const uint8_t*>(src);
  while (len > 0) {
    ssize_t put = ::pwrite(fd, p, len, static_cast<off_t>(off));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return kIoError;
    p += put;
    off += static_cast<uint64_t>(put);
    len -= static_cast<uint64_t>(put);
  }
  return kOk;
}

int32_t Reader::fill(size_t limit) {
  if (head_ == tail_) {
    head_ = tail_ = 0;
  } else if (head_ > buf_.size() / 2) {
    std::memmove(buf_.data(), buf_.data() + head_, tail_ - head_);
    tail_ -= head_;
    head_ = 0;
  }
  for (;;) {
    ssize_t r = ::recv(fd_, buf_.data() + tail_, std::min(limit, buf_.size() - tail_), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return errno_status(r);
    tail_ += static_cast<size_t>(r);
    return kOk;
  }
}

int32_t Reader::read(void* dst, size_t n) {
  auto p = static_cast<uint8_t*>(dst);
  size_t take = std::min(n, buffered());
  std::memcpy(p, buf_.data() + head_, take);
  head_ += take;
  p += take;
  n -= take;
  if (n >= 64 * 1024) return recv_exact(fd_, p, n);  // large payload: no bounce
  while (n > 0) {
    if (int32_t st = fill(); st != kOk) return st;
    take = std::min(n, buffered());
    std::memcpy(p, buf_.data() + head_, take);
    head_ += take;
    p += take;
    n -= take;
  }
  return kOk;
}

int32_t Reader::discard(size_t n) {
  while (n > 0) {
    if (buffered() == 0) {
      if (int32_t st = fill(); st != kOk) return st;
    }
    size_t take = std::min(n, buffered());
    head_ += take;
    n -= take;
  }
  return kOk;
}

int32_t Reader::read_into_region(Region& r, uint64_t off, uint64_t len) {
  if (r.kind == RegionKind::kMemory) return read(r.base + off, len);
  AlignedBuffer bounce(len);
  if (int32_t st = read(bounce.data(), len); st != kOk) return st;
  return region_write(r, off, bounce.data(), len);
}

void Writer::header(const RespHeader& h) {
  headers_.push_back(h);
  iov_.push_back({&headers_.back(), sizeof(RespHeader)});
  pending_ += sizeof(RespHeader);
}

void Writer::payload(const void* p, size_t n, RegionPtr pin) {
  iov_.push_back({const_cast<void*>(p), n});
  pins_.push_back(std::move(pin));
  pending_ += n;
}

void Writer::raw(const void* p, size_t n) {
  raw_.emplace_back();
  n = std::min(n, raw_.back().size());
  std::memcpy(raw_.back().data(), p, n);
  iov_.push_back({raw_.back().data(), n});
  pending_ += n;
}

void Writer::owned_payload(AlignedBuffer&& bytes, std::unique_ptr<BudgetHold> hold) {
  if (hold) holds_.push_back(std::move(hold));
  owned_.push_back(std::move(bytes));
  iov_.push_back({owned_.back().data(), owned_.back().size()});
  pending_ += owned_.back().size();
}

int32_t Writer::flush() {
  int32_t st = iov_.empty() ? kOk : writev_all(fd_, iov_);
  iov_.clear();
  headers_.clear();
  raw_.clear();
  owned_.clear();
  holds_.clear();
  pins_.clear();
  pending_ = 0;
  return st;
}

}  // namespace kvt
