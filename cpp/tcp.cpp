#include "tcp.h"

#include <errno.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "io.h"

namespace kvt {

namespace {
constexpr uint64_t kMaxPiece = 16ull << 20;    // largest piece of an op on one stream
constexpr uint64_t kMaxDiscard = 64ull << 20;  // refused writes longer than this close the link
constexpr uint64_t kMaxFileOp = 64ull << 20;   // file ops go through a bounce buffer of this size
constexpr size_t kFlushBytes = 4u << 20;
constexpr size_t kFlushIov = 512;
constexpr uint64_t kInlineSendBytes = 64 * 1024;
}  // namespace

Stream::Stream(int fd, uint64_t stall_ms, Counters* counters)
    : fd_(fd), stall_ms_(stall_ms), counters_(counters) {
  set_stream_options(fd_, stall_ms_);
  sender_ = std::thread([this] { send_loop(); });
  receiver_ = std::thread([this] { recv_loop(); });
}

Stream::~Stream() {
  shutdown();
  if (sender_.joinable()) sender_.join();
  if (receiver_.joinable()) receiver_.join();
  ::close(fd_);
}

void Stream::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
  }
  ::shutdown(fd_, SHUT_RDWR);
  send_cv_.notify_all();
}

bool Stream::broken() const {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_ || closing_;
}

void Stream::mark_broken(int32_t status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_) {
      broken_ = true;
      broken_status_ = closing_ ? kClosed : status;
    }
  }
  ::shutdown(fd_, SHUT_RDWR);
  send_cv_.notify_all();
}

void Stream::finish(SubReq& r, int32_t status) {
  queued_.fetch_sub(r.len, std::memory_order_relaxed);
  r.batch->part_done(r.op, status, status == kOk ? r.len : 0);
  r.batch.reset();
  r.local.reset();
}

void Stream::fail(std::deque<SubReq>& reqs, int32_t status) {
  for (auto& r : reqs) finish(r, status);
  reqs.clear();
}

bool Stream::enqueue(std::vector<SubReq>& reqs) {
  uint64_t payload = 0;
  for (auto& r : reqs) {
    queued_.fetch_add(r.len, std::memory_order_relaxed);
    if (r.opcode == kWrite) payload += r.len;
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (broken_ || closing_) {
    int32_t st = closing_ ? kClosed : broken_status_;
    lock.unlock();
    for (auto& r : reqs) finish(r, st);
    return false;
  }
  // Inline fast path: saves a thread hand-off per small batch; big writes stay asynchronous.
  if (to_send_.empty() && payload <= kInlineSendBytes) {
    std::unique_lock<std::mutex> sending(send_mu_, std::try_to_lock);
    if (sending.owns_lock()) {
      lock.unlock();
      send_batch(reqs);
      return true;
    }
  }
  for (auto& r : reqs) to_send_.push_back(std::move(r));
  lock.unlock();
  send_cv_.notify_one();
  return true;
}

void Stream::send_loop() {
  for (;;) {
    std::vector<SubReq> batch;
    {
      std::unique_lock<std::mutex> lock(mu_);
      send_cv_.wait(lock, [this] { return closing_ || broken_ || !to_send_.empty(); });
      if (closing_ || broken_) {
        std::deque<SubReq> left;
        left.swap(to_send_);
        int32_t st = closing_ ? kClosed : broken_status_;
        lock.unlock();
        fail(left, st);
        return;
      }
    }
    std::lock_guard<std::mutex> sending(send_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      batch.reserve(to_send_.size());
      for (auto& r : to_send_) batch.push_back(std::move(r));
      to_send_.clear();
    }
    if (!batch.empty()) send_batch(batch);
  }
}

void Stream::send_batch(std::vector<SubReq>& batch) {
  std::vector<ReqHeader> headers;
  std::vector<iovec> iov;
  std::vector<RegionPtr> pins;  // keep local memory alive until writev is done with it
  std::deque<AlignedBuffer> bounces;
  headers.reserve(batch.size());  // iovecs point into it: no reallocation below
  std::vector<SubReq> sending;
  sending.reserve(batch.size());
  uint64_t payload = 0;
  for (auto& r : batch) {
    const uint8_t* src = nullptr;
    if (r.opcode == kWrite) {
      if (r.local->kind == RegionKind::kMemory) {
        src = r.local->base + r.local_off;
      } else {
        bounces.emplace_back(r.len);
        if (region_read(*r.local, r.local_off, bounces.back().data(), r.len) != kOk) {
          finish(r, kIoError);
          continue;
        }
        src = bounces.back().data();
      }
    }
    headers.push_back(ReqHeader{kMagic, r.opcode, {0, 0, 0}, r.remote_region, r.remote_off, r.len});
    iov.push_back({&headers.back(), sizeof(ReqHeader)});
    if (src) {
      iov.push_back({const_cast<uint8_t*>(src), r.len});
      payload += r.len;
    }
    pins.push_back(r.local);
    sending.push_back(std::move(r));
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closing_ || broken_) {  // the receiver is gone: nobody would complete these
      int32_t st = closing_ ? kClosed : broken_status_;
      lock.unlock();
      for (auto& r : sending) finish(r, st);
      return;
    }
    if (in_flight_.empty()) activity_ = std::chrono::steady_clock::now();
    for (auto& r : sending) in_flight_.push_back(std::move(r));
  }
  int32_t st = writev_all(fd_, iov);
  if (st != kOk) {
    mark_broken(st);
  } else {
    counters_->tcp_tx.fetch_add(payload, std::memory_order_relaxed);
  }
}

bool Stream::next_is_large_read() {
  std::lock_guard<std::mutex> lock(mu_);
  return !in_flight_.empty() && in_flight_.front().opcode == kRead && in_flight_.front().len >= 64 * 1024;
}

bool Stream::stalled() {
  std::lock_guard<std::mutex> lock(mu_);
  if (in_flight_.empty()) return false;  // idle: silence is expected
  return std::chrono::steady_clock::now() - activity_ >= std::chrono::milliseconds(stall_ms_);
}

void Stream::recv_loop() {
  Reader reader(fd_);
  int32_t st = kOk;
  while (st == kOk) {
    while (st == kOk && reader.buffered() < sizeof(RespHeader)) {
      st = reader.fill(next_is_large_read() ? sizeof(RespHeader) - reader.buffered() : Reader::kDefaultFill);
      if (st == kTimeout && !stalled()) st = kOk;
    }
    if (st != kOk) break;
    RespHeader h{};
    reader.read(&h, sizeof h);
    SubReq req;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (in_flight_.empty()) {
        st = kProtocol;  // a response nobody asked for
        break;
      }
      req = std::move(in_flight_.front());
      in_flight_.pop_front();
      activity_ = std::chrono::steady_clock::now();
    }
    int32_t result = h.status;
    if (h.status == kOk && req.opcode == kRead) {
      if (h.length != req.len) {
        st = kProtocol;
      } else {
        st = reader.read_into_region(*req.local, req.local_off, req.len);
        if (st == kOk) counters_->tcp_rx.fetch_add(req.len, std::memory_order_relaxed);
      }
    } else if (h.length != 0 || h.status < kOk || h.status > kInvalid || h.status == kPending) {
      st = kProtocol;
    }
    finish(req, st == kOk ? result : st);
  }
  mark_broken(st);
  std::deque<SubReq> left;
  int32_t status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(in_flight_);
    status = broken_status_;
  }
  fail(left, status);  // the sender fails anything it moves in after this (it checks broken_)
}

Peer::Peer(const std::vector<int>& fds, uint64_t stall_ms, uint64_t stripe_bytes, Counters* counters)
    : stripe_bytes_(std::max<uint64_t>(stripe_bytes, 4096)) {
  for (int fd : fds) streams_.push_back(std::make_unique<Stream>(fd, stall_ms, counters));
}

bool Peer::alive() const {
  for (auto& s : streams_)
    if (s->broken()) return false;
  return !streams_.empty();
}

void Peer::shutdown() {
  for (auto& s : streams_) s->shutdown();
}

void Peer::dispatch(std::vector<SubReq>& reqs) {
  const uint64_t n = streams_.size();
  std::vector<std::vector<SubReq>> per_stream(n);
  std::vector<uint64_t> load(n);
  for (uint64_t i = 0; i < n; ++i) load[i] = streams_[i]->broken() ? UINT64_MAX / 2 : streams_[i]->queued_bytes();
  for (auto& r : reqs) {
    uint64_t parts = (r.len + kMaxPiece - 1) / kMaxPiece;
    if (r.len >= 2 * stripe_bytes_) parts = std::max<uint64_t>(parts, std::min<uint64_t>(n, r.len / stripe_bytes_));
    parts = std::max<uint64_t>(parts, 1);
    // Pieces are multiples of 4 KiB (except the last) so O_DIRECT stays possible at both ends.
    uint64_t piece = ((r.len + parts - 1) / parts + 4095) / 4096 * 4096;
    parts = (r.len + piece - 1) / piece;
    r.batch->set_parts(r.op, static_cast<uint32_t>(parts));
    for (uint64_t done = 0; done < r.len;) {
      uint64_t len = std::min(piece, r.len - done);
      uint64_t best = static_cast<uint64_t>(std::min_element(load.begin(), load.end()) - load.begin());
      load[best] += len + sizeof(ReqHeader);
      per_stream[best].push_back(SubReq{r.batch, r.op, r.opcode, r.local, r.local_off + done, r.remote_region,
                                        r.remote_off + done, len});
      done += len;
    }
  }
  for (uint64_t i = 0; i < n; ++i)
    if (!per_stream[i].empty()) streams_[i]->enqueue(per_stream[i]);
}

void serve_connection(int fd, const RegionTable& regions, uint64_t stall_ms, Counters* counters,
                      const std::atomic<bool>& closing) {
  set_stream_options(fd, stall_ms);
  Reader reader(fd);
  Writer writer(fd);
  while (!closing.load(std::memory_order_relaxed)) {
    if (reader.buffered() < sizeof(ReqHeader)) {
      if (writer.flush() != kOk) break;
      bool idle = reader.buffered() == 0;
      int32_t st = reader.fill();
      if (st == kTimeout && idle) continue;  // quiet between requests is fine; mid-header is a stall
      if (st != kOk) break;
      continue;
    }
    ReqHeader h{};
    if (reader.read(&h, sizeof h) != kOk) break;
    if (h.magic != kMagic || (h.opcode != kRead && h.opcode != kWrite)) break;
    RegionPtr r = regions.get(h.region);
    int32_t st = kOk;
    if (!r || !r->remote_access) {
      st = kUnknownRegion;
    } else if (!r->contains(h.offset, h.length)) {
      st = kOutOfBounds;
    } else if (h.opcode == kWrite && r->readonly) {
      st = kReadOnly;
    } else if (r->kind == RegionKind::kFile && h.length > kMaxFileOp) {
      st = kInvalid;
    }
    if (st != kOk) counters->refused_ops.fetch_add(1, std::memory_order_relaxed);
    if (h.opcode == kWrite) {
      if (st == kOk && r->kind == RegionKind::kMemory) {
        if (reader.read(r->base + h.offset, h.length) != kOk) break;
      } else if (st == kOk) {
        AlignedBuffer bounce(h.length);
        if (reader.read(bounce.data(), h.length) != kOk) break;
        st = region_write(*r, h.offset, bounce.data(), h.length);
      } else {
        if (h.length > kMaxDiscard || reader.discard(h.length) != kOk) break;
      }
      if (st == kOk) counters->tcp_rx.fetch_add(h.length, std::memory_order_relaxed);
      writer.header(RespHeader{st, 0, 0});
    } else if (st == kOk && r->kind == RegionKind::kFile) {
      AlignedBuffer bounce(h.length);
      st = region_read(*r, h.offset, bounce.data(), h.length);
      writer.header(RespHeader{st, 0, st == kOk ? h.length : 0});
      if (st == kOk) writer.owned_payload(std::move(bounce));
    } else if (st == kOk) {
      writer.header(RespHeader{kOk, 0, h.length});
      writer.payload(r->base + h.offset, h.length, r);
    } else {
      writer.header(RespHeader{st, 0, 0});
    }
    if (st == kOk && h.opcode == kRead) counters->tcp_tx.fetch_add(h.length, std::memory_order_relaxed);
    counters->served_ops.fetch_add(1, std::memory_order_relaxed);
    if (writer.pending_bytes() >= kFlushBytes || writer.pending_iov() >= kFlushIov) {
      if (writer.flush() != kOk) break;
    }
  }
  ::shutdown(fd, SHUT_RDWR);
}

}  // namespace kvt
