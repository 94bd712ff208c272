#include "engine.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "io.h"

namespace kvt {

namespace {
constexpr uint64_t kInlineBytes = 256 * 1024;  // below this a local batch runs in submit()
constexpr uint64_t kLocalPiece = 4ull << 20;   // large local copies split for the pool

int32_t copy_between(Region& dst, uint64_t dst_off, Region& src, uint64_t src_off, uint64_t len) {
  if (dst.kind == RegionKind::kMemory) return region_read(src, src_off, dst.base + dst_off, len);
  if (src.kind == RegionKind::kMemory) return region_write(dst, dst_off, src.base + src_off, len);
  AlignedBuffer bounce(std::min<uint64_t>(len, 4ull << 20));
  for (uint64_t done = 0; done < len;) {
    uint64_t n = std::min<uint64_t>(bounce.size(), len - done);
    if (int32_t st = region_read(src, src_off + done, bounce.data(), n); st != kOk) return st;
    if (int32_t st = region_write(dst, dst_off + done, bounce.data(), n); st != kOk) return st;
    done += n;
  }
  return kOk;
}
}  // namespace

WorkerPool::WorkerPool(int n) {
  for (int i = 0; i < n; ++i) {
    threads_.emplace_back([this] {
      for (;;) {
        std::function<void()> task;
        {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
          if (tasks_.empty()) return;
          task = std::move(tasks_.front());
          tasks_.pop_front();
        }
        try {
          task();
        } catch (...) {
          // Tasks report their own failures; nothing may unwind out of a worker thread.
        }
      }
    });
  }
}

WorkerPool::~WorkerPool() { stop(); }

void WorkerPool::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void WorkerPool::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
}

Engine::Engine(uint64_t stall_ms, uint64_t stripe_bytes, int local_workers, uint64_t bounce_limit)
    : stall_ms_(stall_ms), stripe_bytes_(stripe_bytes), budget_(bounce_limit), pool_(std::max(1, local_workers)) {}

Engine::~Engine() { close(); }

uint64_t Engine::register_memory(uintptr_t ptr, uint64_t size, bool readonly, bool remote_access,
                                 uint8_t remote_writes) {
  auto r = std::make_shared<Region>();
  r->remote_writes = remote_writes;
  r->kind = RegionKind::kMemory;
  r->base = reinterpret_cast<uint8_t*>(ptr);
  r->size = size;
  r->readonly = readonly;
  r->remote_access = remote_access;
  return regions_.add(std::move(r));
}

uint64_t Engine::register_file(const std::string& path, uint64_t size, bool readonly,
                               bool remote_access, std::string* err, uint8_t remote_writes) {
  int flags = (readonly ? O_RDONLY : O_RDWR | O_CREAT) | O_CLOEXEC;
  int fd = ::open(path.c_str(), flags, 0600);
  if (fd < 0) {
    *err = std::string("open ") + path + ": " + std::strerror(errno);
    return 0;
  }
  auto r = std::make_shared<Region>();
  r->fd = fd;
  r->kind = RegionKind::kFile;
  r->remote_writes = remote_writes;
  r->size = size;
  r->readonly = readonly;
  r->remote_access = remote_access;
  off_t cur = ::lseek(fd, 0, SEEK_END);
  if (!readonly && cur >= 0 && static_cast<uint64_t>(cur) < size) {
    // Reserve the blocks now so a full disk shows up here, not in the middle of a transfer.
    int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(size));
    if (rc != 0) {
      *err = std::string("allocate ") + std::to_string(size) + " bytes for " + path + ": " + std::strerror(rc);
      return 0;
    }
  } else if (cur >= 0 && static_cast<uint64_t>(cur) < size) {
    *err = path + " is smaller than the requested region";
    return 0;
  }
  r->direct_fd = ::open(path.c_str(), (readonly ? O_RDONLY : O_RDWR) | O_DIRECT | O_CLOEXEC);
  return regions_.add(std::move(r));
}

bool Engine::unregister(uint64_t id, double wait_s) {
  RegionPtr r = regions_.remove(id);
  if (!r) return true;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  while (r.use_count() > 1) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::lock_guard<std::mutex> lock(graveyard_mu_);
      graveyard_[id] = r;
      return false;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

bool Engine::released(uint64_t id) {
  std::lock_guard<std::mutex> lock(graveyard_mu_);
  auto it = graveyard_.find(id);
  if (it == graveyard_.end()) return true;
  if (!it->second.expired()) return false;
  graveyard_.erase(it);
  return true;
}

uint32_t Engine::add_peer(const std::vector<int>& fds, const std::vector<WireKeys>& keys) {
  auto peer = std::make_shared<Peer>(fds, keys, stall_ms_, stripe_bytes_, &counters_);
  std::lock_guard<std::mutex> lock(peers_mu_);
  uint32_t id = next_peer_++;
  peers_[id] = std::move(peer);
  return id;
}

bool Engine::peer_alive(uint32_t id) {
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto it = peers_.find(id);
  return it != peers_.end() && it->second->alive();
}

std::vector<uint64_t> Engine::peer_stream_bytes(uint32_t id) {
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto it = peers_.find(id);
  return it == peers_.end() ? std::vector<uint64_t>{} : it->second->stream_bytes();
}

void Engine::remove_peer(uint32_t id) {
  std::shared_ptr<Peer> peer;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peers_.find(id);
    if (it == peers_.end()) return;
    peer = std::move(it->second);
    peers_.erase(it);
  }
  peer->shutdown();  // its streams join when `peer` goes out of scope here
}

void Engine::stop_connections() {
  std::unique_lock<std::mutex> lock(conns_->mu);
  for (int fd : conns_->fds) ::shutdown(fd, SHUT_RDWR);
  conns_->cv.wait(lock, [this] { return conns_->active == 0; });
}

int Engine::serving() const {
  std::lock_guard<std::mutex> lock(conns_->mu);
  return conns_->active;
}

void Engine::serve(int fd, const WireKeys& keys, const std::string& peer) {
  // closing_ is checked under the lock close() takes to stop connections: a connection is either
  // refused here or registered before close() looks, never added after it finished waiting.
  std::lock_guard<std::mutex> lock(conns_->mu);
  if (closing_.load()) {
    ::close(fd);
    return;
  }
  GrantSetPtr grants;
  try {
    if (!peer.empty()) grants = grants_.attach(peer);  // held while the connection is served
  } catch (...) {
    ::close(fd);
    return;
  }
  conns_->fds.insert(fd);
  ++conns_->active;
  try {
    std::thread([this, fd, keys, peer, grants, conns = conns_]() mutable {
      try {
        serve_connection(fd, keys, regions_, stall_ms_, &counters_, &budget_, closing_, grants.get());
      } catch (...) {
        // e.g. bad_alloc: this connection ends, the process goes on
      }
      if (grants) grants_.detach(grants, peer);
      std::lock_guard<std::mutex> done(conns->mu);
      conns->fds.erase(fd);
      ::close(fd);
      if (--conns->active == 0) conns->cv.notify_all();
    }).detach();
  } catch (...) {  // no thread to serve it (e.g. out of threads): refuse the connection
    if (grants) grants_.detach(grants, peer);
    conns_->fds.erase(fd);
    --conns_->active;
    ::close(fd);
  }
}

uint32_t Engine::add_ucx_peer(uintptr_t worker, uintptr_t ep, int watch_fd) {
  auto peer = std::make_shared<UcxPeer>(reinterpret_cast<void*>(worker), reinterpret_cast<void*>(ep), watch_fd);
  std::lock_guard<std::mutex> lock(peers_mu_);
  uint32_t id = kUcxRoute | next_ucx_++;
  ucx_peers_[id] = std::move(peer);
  return id;
}

void Engine::ucx_key(uint32_t route, uint64_t region, const UcxKey& key) {
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto it = ucx_peers_.find(route);
  if (it != ucx_peers_.end()) it->second->set_key(region, key);
}

void Engine::remove_ucx_peer(uint32_t route) {
  UcxPeerPtr peer;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = ucx_peers_.find(route);
    if (it == ucx_peers_.end()) return;
    peer = std::move(it->second);
    ucx_peers_.erase(it);
  }
  peer->retire();  // returns once no batch is issuing ops on it: Python may close the endpoint
}

std::vector<uint32_t> Engine::ucx_broken() {
  std::vector<uint32_t> out;
  std::lock_guard<std::mutex> lock(peers_mu_);
  for (auto& kv : ucx_peers_)
    if (kv.second->broken()) out.push_back(kv.first);
  return out;
}

bool Engine::set_ucx_memh(uint64_t region, uintptr_t memh, bool cuda, uintptr_t address) {
  RegionPtr r = regions_.get(region);
  if (!r) return false;
  r->ucx_cuda.store(cuda);
  r->ucx_base.store(reinterpret_cast<uint8_t*>(address));
  r->ucx_memh.store(reinterpret_cast<void*>(memh));
  return true;
}

BatchPtr Engine::submit(const std::vector<OpSpec>& ops) {
  auto batch = std::make_shared<Batch>(ops.size());
  std::vector<UcxItem> ucx;
  std::vector<UcxPeer*> ucx_checked;  // peers whose liveness this batch has checked
  std::vector<Piece> pieces;
  uint64_t local_bytes = 0;
  struct PeerOps {
    std::shared_ptr<Peer> peer;
    std::vector<SubReq> reqs;
  };
  std::map<uint32_t, PeerOps> remote;
  for (uint32_t i = 0; i < ops.size(); ++i) {
    const OpSpec& op = ops[i];
    if (closing_.load()) {
      batch->part_done(i, kClosed, 0);
      continue;
    }
    RegionPtr local = regions_.get(op.local_region);
    if (!local) {
      batch->part_done(i, kUnknownRegion, 0);
      continue;
    }
    if (!local->contains(op.local_off, op.len)) {
      batch->part_done(i, kOutOfBounds, 0);
      continue;
    }
    if (op.opcode == kRead && local->readonly) {
      batch->part_done(i, kReadOnly, 0);
      continue;
    }
    if (op.opcode != kRead && op.opcode != kWrite) {
      batch->part_done(i, kInvalid, 0);
      continue;
    }
    if (op.len == 0) {
      batch->part_done(i, kOk, 0);
      continue;
    }
    if (op.route == 0) {
      RegionPtr other = regions_.get(op.remote_region);
      int32_t st = kOk;
      if (!other) st = kUnknownRegion;
      else if (!other->contains(op.remote_off, op.len)) st = kOutOfBounds;
      else if (op.opcode == kWrite && other->readonly) st = kReadOnly;
      if (st != kOk) {
        batch->part_done(i, st, 0);
        continue;
      }
      bool read = op.opcode == kRead;
      uint64_t parts = std::max<uint64_t>(1, (op.len + kLocalPiece - 1) / kLocalPiece);
      batch->set_parts(i, static_cast<uint32_t>(parts));
      for (uint64_t done = 0; done < op.len; done += kLocalPiece) {
        uint64_t n = std::min(kLocalPiece, op.len - done);
        if (read) pieces.push_back(Piece{i, local, other, op.local_off + done, op.remote_off + done, n});
        else pieces.push_back(Piece{i, other, local, op.remote_off + done, op.local_off + done, n});
      }
      local_bytes += op.len;
      continue;
    }
    if (op.route & kUcxRoute) {
      if (int32_t st = plan_ucx(op, i, local, &ucx, &ucx_checked); st != kOk) batch->part_done(i, st, 0);
      continue;
    }
    auto it = remote.find(op.route);
    if (it == remote.end()) {
      std::lock_guard<std::mutex> lock(peers_mu_);
      auto p = peers_.find(op.route);
      it = remote.emplace(op.route, PeerOps{p == peers_.end() ? nullptr : p->second, {}}).first;
    }
    if (!it->second.peer) {
      batch->part_done(i, kPeerClosed, 0);
      continue;
    }
    it->second.reqs.push_back(SubReq{batch, i, op.opcode, local, op.local_off, op.remote_region, op.remote_off, op.len});
  }
  for (auto& kv : remote)
    if (kv.second.peer) kv.second.peer->dispatch(kv.second.reqs);
  if (!pieces.empty()) run_pieces(batch, pieces, local_bytes);
  if (!ucx.empty()) {
    auto ops_ucx = std::make_unique<UcxOps>(batch.get(), std::move(ucx), stall_ms_, &counters_.ucx_bytes, ucx_gate_);
    UcxOps* started = ops_ucx.get();
    batch->set_poller(std::move(ops_ucx));
    started->start();
  }
  return batch;
}

int32_t Engine::plan_ucx(const OpSpec& op, uint32_t index, const RegionPtr& local, std::vector<UcxItem>* out,
                         std::vector<UcxPeer*>* checked) {
  if (!ucx_loaded()) return kInvalid;
  UcxPeerPtr peer;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = ucx_peers_.find(op.route);
    if (it != ucx_peers_.end()) peer = it->second;
  }
  if (!peer) return kPeerClosed;
  if (std::find(checked->begin(), checked->end(), peer.get()) == checked->end()) {
    // Without peer-failure handling UCX aborts this process on a dead peer: refuse it up front.
    if (peer->gone()) peer->mark_broken();
    checked->push_back(peer.get());
  }
  if (peer->broken()) return kPeerClosed;
  UcxKey key;
  if (!peer->key(op.remote_region, &key)) return kUnknownRegion;
  if (!local->ucx_memh.load() || local->kind != RegionKind::kMemory) return kInvalid;
  // Checked here against what the peer advertised: over tcp and shared memory UCX checks nothing.
  if (!key.contains(op.remote_off, op.len)) return kOutOfBounds;
  if (op.opcode == kWrite && key.readonly) return kReadOnly;
  uint8_t* base = local->ucx_base.load();
  out->push_back(UcxItem{index, op.opcode == kWrite, std::move(peer), local, (base ? base : local->base) + op.local_off,
                         key.addr + op.remote_off, op.len, key.rkey});
  return kOk;
}

void Engine::run_pieces(const BatchPtr& batch, std::vector<Piece>& pieces, uint64_t total) {
  auto run = [this](const BatchPtr& b, Piece* first, Piece* last) {
    for (Piece* p = first; p != last; ++p) {
      int32_t st = kOk;
      try {
        st = copy_between(*p->dst, p->dst_off, *p->src, p->src_off, p->len);
      } catch (...) {  // bounce allocation failed: this op fails, the batch still completes
        st = kIoError;
      }
      bool file = p->dst->kind == RegionKind::kFile || p->src->kind == RegionKind::kFile;
      (file ? counters_.file_bytes : counters_.local_bytes).fetch_add(st == kOk ? p->len : 0);
      b->part_done(p->op, st, st == kOk ? p->len : 0);
    }
  };
  if (total <= kInlineBytes) {
    run(batch, pieces.data(), pieces.data() + pieces.size());
    return;
  }
  // Contiguous groups of roughly equal bytes, one per worker.
  auto shared = std::make_shared<std::vector<Piece>>(std::move(pieces));
  size_t groups = std::min<size_t>(pool_.size(), shared->size());
  uint64_t target = (total + groups - 1) / groups, acc = 0;
  size_t start = 0;
  for (size_t i = 0; i < shared->size(); ++i) {
    acc += (*shared)[i].len;
    bool last = i + 1 == shared->size();
    if (acc >= target || last) {
      size_t end = i + 1;
      pool_.post([run, batch, shared, start, end] { run(batch, shared->data() + start, shared->data() + end); });
      start = end;
      acc = 0;
    }
  }
}

std::map<std::string, uint64_t> Engine::stats() const {
  return {{"tcp_tx_bytes", counters_.tcp_tx.load()},       {"tcp_rx_bytes", counters_.tcp_rx.load()},
          {"local_bytes", counters_.local_bytes.load()},   {"file_bytes", counters_.file_bytes.load()},
          {"ucx_bytes", counters_.ucx_bytes.load()},
          {"served_ops", counters_.served_ops.load()},     {"refused_ops", counters_.refused_ops.load()},
          {"bounce_bytes", budget_.used()},                {"bounce_limit", budget_.limit()},
          {"write_grants", grants_.count()}};
}

void Engine::close() {
  {
    std::lock_guard<std::mutex> lock(conns_->mu);
    if (closing_.exchange(true)) return;
  }
  stop_connections();
  std::map<uint32_t, std::shared_ptr<Peer>> peers;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    peers.swap(peers_);
  }
  for (auto& kv : peers) kv.second->shutdown();
  peers.clear();
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    ucx_peers_.clear();
  }
  {
    std::unique_lock<std::shared_mutex> gate(ucx_gate_->mu);  // waits out UCX calls in progress
    ucx_gate_->open = false;  // before Python destroys the UCX worker: batches stop calling into it
  }
  pool_.stop();
  regions_.clear();
}

}  // namespace kvt
