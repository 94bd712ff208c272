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

Stream::Stream(int fd, uint64_t stall_ms, Counters* counters, const WireKeys& keys)
    : fd_(fd), stall_ms_(stall_ms), counters_(counters) {
  if (keys.enabled()) {
    tx_ = std::make_unique<Aead>(reinterpret_cast<const uint8_t*>(keys.tx.data()));
    rx_ = std::make_unique<Aead>(reinterpret_cast<const uint8_t*>(keys.rx.data()));
  }
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
  r.local.reset();  // unpinned before the op is reported done: a waiter may unregister it next
  BatchPtr batch = std::move(r.batch);
  batch->part_done(r.op, status, status == kOk ? r.len : 0);
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
      send_guarded(reqs);
      return true;
    }
  }
  for (auto& r : reqs) to_send_.push_back(std::move(r));
  lock.unlock();
  send_cv_.notify_one();
  return true;
}

void Stream::send_guarded(std::vector<SubReq>& batch) {
  try {
    if (tx_) send_sealed(batch);
    else send_batch(batch);
  } catch (...) {  // e.g. bad_alloc: fail this stream's ops, keep the process
    for (auto& r : batch)
      if (r.batch) finish(r, kIoError);
    mark_broken(kIoError);
  }
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
    if (!batch.empty()) send_guarded(batch);
  }
}

void Stream::send_sealed(std::vector<SubReq>& batch) {
  struct Out {
    uint8_t opcode;
    RegionPtr local;  // pinned here: the receiver may fail and drop its SubReq while we send
    uint64_t local_off, remote_region, remote_off, len;
  };
  std::vector<Out> outs;
  outs.reserve(batch.size());
  for (auto& r : batch) outs.push_back(Out{r.opcode, r.local, r.local_off, r.remote_region, r.remote_off, r.len});
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closing_ || broken_) {
      int32_t st = closing_ ? kClosed : broken_status_;
      lock.unlock();
      for (auto& r : batch) finish(r, st);
      return;
    }
    if (in_flight_.empty()) activity_ = std::chrono::steady_clock::now();
    for (auto& r : batch) in_flight_.push_back(std::move(r));
  }
  // Requests are in flight in wire order (send_mu_ is held); each goes out as a sealed header and,
  // for writes, a sealed payload. Output is gathered and sent every few MiB.
  sealed_out_.clear();
  auto flush = [&]() -> bool {
    if (sealed_out_.empty()) return true;
    int32_t st = send_all(fd_, sealed_out_.data(), sealed_out_.size());
    sealed_out_.clear();
    if (st != kOk) mark_broken(st);
    return st == kOk;
  };
  for (auto& o : outs) {
    ReqHeader h{kMagic, o.opcode, {0, 0, 0}, o.remote_region, o.remote_off, o.len};
    size_t at = sealed_out_.size();
    sealed_out_.resize(at + sizeof h + kTagBytes + (o.opcode == kWrite ? o.len + kTagBytes : 0));
    uint8_t* p = sealed_out_.data() + at;
    bool ok = tx_->seal(reinterpret_cast<uint8_t*>(&h), sizeof h, p, p + sizeof h);
    if (ok && o.opcode == kWrite) {
      uint8_t* body = p + sizeof h + kTagBytes;
      if (o.local->kind == RegionKind::kMemory) {
        ok = tx_->seal(o.local->base + o.local_off, o.len, body, body + o.len);
      } else {
        ok = region_read(*o.local, o.local_off, body, o.len) == kOk && tx_->seal(body, o.len, body, body + o.len);
      }
      moved_.fetch_add(o.len, std::memory_order_relaxed);
    }
    if (!ok) {  // the request is in flight already: the stream cannot go on
      mark_broken(kIoError);
      return;
    }
    if (o.opcode == kWrite) counters_->tcp_tx.fetch_add(o.len, std::memory_order_relaxed);
    if (sealed_out_.size() >= kFlushBytes) {
      if (!flush()) return;
      for (auto* q = outs.data(); q <= &o; ++q) q->local.reset();  // sent: no longer ours to pin
    }
  }
  flush();
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
  // Counted before the write: the response (and the caller's wait) can come before writev returns.
  counters_->tcp_tx.fetch_add(payload, std::memory_order_relaxed);
  moved_.fetch_add(payload, std::memory_order_relaxed);
  int32_t st = writev_all(fd_, iov);
  if (st != kOk) mark_broken(st);
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
  int32_t st;
  try {
    st = recv_frames();
  } catch (...) {  // e.g. bad_alloc: fail this stream's ops, keep the process
    st = kIoError;
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

int32_t Stream::recv_frames() {
  Reader reader(fd_);
  int32_t st = kOk;
  const size_t header_bytes = sizeof(RespHeader) + (rx_ ? kTagBytes : 0);
  while (st == kOk) {
    while (st == kOk && reader.buffered() < header_bytes) {
      st = reader.fill(next_is_large_read() ? header_bytes - reader.buffered() : Reader::kDefaultFill);
      if (st == kTimeout && !stalled()) st = kOk;
    }
    if (st != kOk) break;
    RespHeader h{};
    if (rx_) {
      uint8_t raw[sizeof(RespHeader) + kTagBytes];
      reader.read(raw, sizeof raw);
      if (!rx_->open(raw, sizeof h, reinterpret_cast<uint8_t*>(&h), raw + sizeof h)) {
        st = kProtocol;  // forged or injected: nothing from this stream can be trusted now
        break;
      }
    } else {
      reader.read(&h, sizeof h);
    }
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
      } else if (rx_) {
        // Decrypted straight into our own destination when it is memory: a forged payload fails the
        // op (kProtocol) like any failed read, whose destination bytes are undefined. The owner's
        // side never does this (see serve_connection): its regions are shared with other peers.
        sealed_in_.resize(req.len + kTagBytes);
        st = reader.read(sealed_in_.data(), sealed_in_.size());
        const bool direct = req.local->kind == RegionKind::kMemory;
        uint8_t* out = direct ? req.local->base + req.local_off : sealed_in_.data();
        if (st == kOk && !rx_->open(sealed_in_.data(), req.len, out, sealed_in_.data() + req.len)) st = kProtocol;
        if (st == kOk && !direct) st = region_write(*req.local, req.local_off, sealed_in_.data(), req.len);
      } else {
        st = reader.read_into_region(*req.local, req.local_off, req.len);
      }
      if (st == kOk) {
        counters_->tcp_rx.fetch_add(req.len, std::memory_order_relaxed);
        moved_.fetch_add(req.len, std::memory_order_relaxed);
      }
    } else if (h.length != 0 || h.status < kOk || h.status > kLastStatus || h.status == kPending) {
      st = kProtocol;
    }
    finish(req, st == kOk ? result : st);
  }
  return st;
}

Peer::Peer(const std::vector<int>& fds, const std::vector<WireKeys>& keys, uint64_t stall_ms, uint64_t stripe_bytes,
           Counters* counters)
    : stripe_bytes_(std::max<uint64_t>(stripe_bytes, 4096)) {
  for (size_t i = 0; i < fds.size(); ++i)
    streams_.push_back(std::make_unique<Stream>(fds[i], stall_ms, counters, i < keys.size() ? keys[i] : WireKeys{}));
}

std::vector<uint64_t> Peer::stream_bytes() const {
  std::vector<uint64_t> out;
  for (auto& s : streams_) out.push_back(s->bytes_moved());
  return out;
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

void serve_connection(int fd, const WireKeys& keys, const RegionTable& regions, uint64_t stall_ms,
                      Counters* counters, BounceBudget* budget, const std::atomic<bool>& closing, GrantSet* grants) {
  set_stream_options(fd, stall_ms);
  std::unique_ptr<Aead> rx, tx;
  if (keys.enabled()) {
    rx = std::make_unique<Aead>(reinterpret_cast<const uint8_t*>(keys.rx.data()));
    tx = std::make_unique<Aead>(reinterpret_cast<const uint8_t*>(keys.tx.data()));
  }
  const uint64_t tag = rx ? kTagBytes : 0;
  const size_t header_bytes = sizeof(ReqHeader) + tag;
  const auto budget_wait = std::chrono::milliseconds(stall_ms);
  Reader reader(fd);
  Writer writer(fd);
  auto respond = [&](int32_t status, uint64_t length) -> bool {
    RespHeader resp{status, 0, length};
    if (!tx) {
      writer.header(resp);
      return true;
    }
    uint8_t sealed[sizeof resp + kTagBytes];
    if (!tx->seal(reinterpret_cast<uint8_t*>(&resp), sizeof resp, sealed, sealed + sizeof resp)) return false;
    writer.raw(sealed, sizeof sealed);
    return true;
  };
  while (!closing.load(std::memory_order_relaxed)) {
    if (reader.buffered() < header_bytes) {
      if (writer.flush() != kOk) break;
      bool idle = reader.buffered() == 0;
      int32_t st = reader.fill();
      if (st == kTimeout && idle) continue;  // quiet between requests is fine; mid-header is a stall
      if (st != kOk) break;
      continue;
    }
    ReqHeader h{};
    if (rx) {
      uint8_t raw[sizeof(ReqHeader) + kTagBytes];
      if (reader.read(raw, sizeof raw) != kOk) break;
      // Only the holder of this connection's key can have sent it: an injected frame ends the link.
      if (!rx->open(raw, sizeof h, reinterpret_cast<uint8_t*>(&h), raw + sizeof h)) break;
    } else if (reader.read(&h, sizeof h) != kOk) {
      break;
    }
    if (h.magic != kMagic || (h.opcode != kRead && h.opcode != kWrite)) break;
    RegionPtr r = regions.get(h.region);
    int32_t st = kOk;
    if (!r || !r->remote_access) {
      st = kUnknownRegion;
    } else if (!r->contains(h.offset, h.length)) {
      st = kOutOfBounds;
    } else if (h.opcode == kWrite && r->readonly) {
      st = kReadOnly;
    } else if (h.opcode == kWrite && r->remote_writes != kWritesAny) {
      // Only inside a range the owner granted this connection's peer (and claimed below while the
      // bytes are copied in, so a revoke never races a write still landing).
      st = r->remote_writes == kWritesNone                               ? kReadOnly
           : grants && grants->covers(h.region, h.offset, h.length) ? kOk
                                                                     : kNotGranted;
    }
    const bool granted = st == kOk && h.opcode == kWrite && r->remote_writes == kWritesGranted;
    // File regions and encrypted streams go through a bounce buffer; its size is capped per op
    // and its bytes come out of the engine-wide budget.
    const bool bounce = st == kOk && (r->kind == RegionKind::kFile || rx);
    if (bounce && h.length > kMaxFileOp) st = kInvalid;
    std::unique_ptr<BudgetHold> hold;
    if (st == kOk && bounce) {
      if (writer.flush() != kOk) break;  // never wait for budget while holding some
      if (budget->acquire(h.length + tag, budget_wait)) {
        hold = std::make_unique<BudgetHold>(budget, h.length + tag);
      } else {
        st = kBusy;
      }
    }
    if (st != kOk) counters->refused_ops.fetch_add(1, std::memory_order_relaxed);
    if (h.opcode == kWrite) {
      Landing landing;  // a granted write's hold on its grant while its bytes go into the region
      if (granted && !bounce && !landing.claim(grants, h.region, h.offset, h.length)) {
        st = kNotGranted;  // revoked since the check above
        counters->refused_ops.fetch_add(1, std::memory_order_relaxed);
      }
      if (st == kOk && !bounce) {
        if (reader.read(r->base + h.offset, h.length) != kOk) break;
      } else if (st == kOk) {
        AlignedBuffer buf(h.length + tag);
        if (reader.read(buf.data(), h.length + tag) != kOk) break;
        if (rx && !rx->open(buf.data(), h.length, buf.data(), buf.data() + h.length)) break;
        // Claimed for the copy only: the grant may have been revoked while the bytes arrived.
        if (granted && !landing.claim(grants, h.region, h.offset, h.length)) {
          st = kNotGranted;
          counters->refused_ops.fetch_add(1, std::memory_order_relaxed);
        } else {
          st = region_write(*r, h.offset, buf.data(), h.length);
        }
      } else {
        if (h.length > kMaxDiscard || reader.discard(h.length + tag) != kOk) break;
        if (rx) rx->skip();  // the refused payload still used a nonce
      }
      landing.done();  // before the answer: a peer told its write is over finds it over
      if (st == kOk) counters->tcp_rx.fetch_add(h.length, std::memory_order_relaxed);
      if (!respond(st, 0)) break;
    } else if (st == kOk && bounce) {
      AlignedBuffer buf(h.length + tag);
      const bool direct = tx && r->kind == RegionKind::kMemory;  // sealed straight from the region
      if (!direct) st = region_read(*r, h.offset, buf.data(), h.length);
      if (!respond(st, st == kOk ? h.length : 0)) break;  // the header takes the next nonce first
      if (st == kOk && tx) {
        const uint8_t* src = direct ? r->base + h.offset : buf.data();
        if (!tx->seal(src, h.length, buf.data(), buf.data() + h.length)) break;
      }
      if (st == kOk) writer.owned_payload(std::move(buf), std::move(hold));
    } else if (st == kOk) {
      writer.header(RespHeader{kOk, 0, h.length});
      writer.payload(r->base + h.offset, h.length, r);
    } else if (!respond(st, 0)) {
      break;
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
