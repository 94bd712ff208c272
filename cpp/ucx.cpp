#include "ucx.h"

#include <dlfcn.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

namespace kvt {
namespace {

// The slice of ucp.h we use (UCX 1.x ABI; the same declarations as transfer/ucx_api.py).
constexpr uint32_t kOpFieldMemoryType = 1u << 6, kOpFieldMemh = 1u << 8;
constexpr int32_t kUcsOk = 0, kUcsInProgress = 1, kUcsErrLast = -100;
constexpr int kMemoryTypeHost = 0, kMemoryTypeCuda = 1;

struct RequestParam {
  uint32_t op_attr_mask = 0, flags = 0;
  void* request = nullptr;
  void* cb = nullptr;
  uint64_t datatype = 0;
  void* user_data = nullptr;
  void* reply_buffer = nullptr;
  int memory_type = 0;
  void* recv_info = nullptr;
  void* memh = nullptr;
};

struct UcpApi {
  void* (*put_nbx)(void*, const void*, size_t, uint64_t, void*, const RequestParam*) = nullptr;
  void* (*get_nbx)(void*, void*, size_t, uint64_t, void*, const RequestParam*) = nullptr;
  void* (*ep_flush_nbx)(void*, const RequestParam*) = nullptr;
  int32_t (*request_check_status)(void*) = nullptr;
  void (*request_free)(void*) = nullptr;
  unsigned (*worker_progress)(void*) = nullptr;
};

UcpApi g_api;
std::atomic<bool> g_loaded{false};
std::mutex g_load_mu;

// ucs_status_ptr_t: null = done at once, a small negative value = failed, else a request.
bool is_request(void* ptr) {
  auto v = reinterpret_cast<intptr_t>(ptr);
  return ptr != nullptr && !(v < 0 && v >= kUcsErrLast);
}
int32_t status_of(void* ptr) { return ptr ? static_cast<int32_t>(reinterpret_cast<intptr_t>(ptr)) : kUcsOk; }

constexpr auto kSpin = std::chrono::milliseconds(2);  // poll this long after UCX last did work, then nap

}  // namespace

bool ucx_load(const std::string& libucp_path, std::string* err) {
  std::lock_guard<std::mutex> lock(g_load_mu);
  if (g_loaded.load()) return true;
  void* lib = ::dlopen(libucp_path.c_str(), RTLD_NOW | RTLD_LOCAL);  // already loaded by ucxx: same copy
  if (!lib) {
    *err = std::string("dlopen ") + libucp_path + ": " + ::dlerror();
    return false;
  }
  UcpApi api;
  bool ok = true;
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(lib, name));
    if (!fn) {
      *err += std::string(err->empty() ? "" : ", ") + name;
      ok = false;
    }
  };
  sym(api.put_nbx, "ucp_put_nbx");
  sym(api.get_nbx, "ucp_get_nbx");
  sym(api.ep_flush_nbx, "ucp_ep_flush_nbx");
  sym(api.request_check_status, "ucp_request_check_status");
  sym(api.request_free, "ucp_request_free");
  sym(api.worker_progress, "ucp_worker_progress");
  if (!ok) {
    *err = libucp_path + " lacks " + *err;
    return false;
  }
  g_api = api;
  g_loaded.store(true);
  return true;
}

bool ucx_loaded() { return g_loaded.load(); }

UcxPeer::UcxPeer(void* worker, void* ep, int watch_fd)
    : worker_(worker), ep_(ep), watch_fd_(watch_fd >= 0 ? ::dup(watch_fd) : -1) {}

UcxPeer::~UcxPeer() {
  if (watch_fd_ >= 0) ::close(watch_fd_);
}

bool UcxPeer::gone() const {
  if (watch_fd_ < 0) return false;
  pollfd p{watch_fd_, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLNVAL)) return true;
  char c;  // readable: a reply in flight (alive) or the end of the stream (gone)
  return ::recv(watch_fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

void UcxPeer::retire() {
  std::unique_lock<std::shared_mutex> lock(use);
  retired = true;
  mark_broken();
}

void UcxPeer::set_key(uint64_t region, const UcxKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  keys_[region] = key;
}

bool UcxPeer::key(uint64_t region, UcxKey* out) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = keys_.find(region);
  if (it == keys_.end()) return false;
  *out = it->second;
  return true;
}

UcxOps::UcxOps(Batch* batch, std::vector<UcxItem> items, uint64_t stall_ms, std::atomic<uint64_t>* bytes,
               UcxGatePtr gate)
    : batch_(batch), items_(std::move(items)), stall_ms_(stall_ms), bytes_(bytes), gate_(std::move(gate)) {}

UcxOps::~UcxOps() {
  std::shared_lock<std::shared_mutex> gate(gate_->mu);
  if (!gate_->open) return;  // the worker (and its requests) may be gone already
  // A request still running when the batch is dropped is released by UCX when it completes.
  for (auto& r : pending_) g_api.request_free(r.ptr);
  for (void* ptr : abandoned_) g_api.request_free(ptr);
}

void UcxOps::fail(const Request& r, int32_t status) {
  if (r.item >= 0) {
    batch_->part_done(items_[r.item].op, status, 0);
    return;
  }
  for (const UcxItem& it : items_)  // a flush: the second part of every write on its endpoint
    if (it.write && it.peer.get() == r.peer) batch_->part_done(it.op, status, 0);
}

void UcxOps::fail_closed() {
  std::vector<Request> left;
  left.swap(pending_);
  for (auto& r : left) fail(r, kClosed);
}

void UcxOps::start() {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_lock<std::shared_mutex> gate(gate_->mu);
  if (!gate_->open) {
    for (auto& it : items_) batch_->part_done(it.op, kClosed, 0);
    return;
  }
  std::vector<UcxPeer*> written;
  std::vector<std::shared_lock<std::shared_mutex>> using_peers;  // held while ops are issued
  std::vector<UcxPeer*> used;
  RequestParam host, cuda;
  for (size_t i = 0; i < items_.size(); ++i) {
    UcxItem& it = items_[i];
    if (std::find(used.begin(), used.end(), it.peer.get()) == used.end()) {
      used.push_back(it.peer.get());
      using_peers.emplace_back(it.peer->use);
    }
    if (it.peer->retired) {  // retired (its endpoint closing) between planning and now
      batch_->part_done(it.op, kPeerClosed, 0);
      continue;
    }
    if (std::find(workers_.begin(), workers_.end(), it.peer->worker()) == workers_.end())
      workers_.push_back(it.peer->worker());
    RequestParam& param = it.local->ucx_cuda.load() ? cuda : host;
    param.op_attr_mask = kOpFieldMemh | (&param == &cuda ? kOpFieldMemoryType : 0);
    param.memory_type = &param == &cuda ? kMemoryTypeCuda : kMemoryTypeHost;
    param.memh = it.local->ucx_memh.load();
    void* ptr = it.write ? g_api.put_nbx(it.peer->ep(), it.local_addr, it.len, it.remote_addr, it.rkey, &param)
                         : g_api.get_nbx(it.peer->ep(), it.local_addr, it.len, it.remote_addr, it.rkey, &param);
    if (it.write) {
      batch_->set_parts(it.op, 2);  // the put and the endpoint's flush
      if (std::find(written.begin(), written.end(), it.peer.get()) == written.end()) written.push_back(it.peer.get());
    }
    Request r{ptr, static_cast<int32_t>(i), it.peer.get()};
    if (is_request(ptr)) pending_.push_back(r);
    else complete(r, status_of(ptr));
  }
  RequestParam plain;
  for (UcxPeer* peer : written) {  // issued after the puts: completes once they have landed
    if (peer->retired) continue;  // (its writes all failed above)
    void* ptr = g_api.ep_flush_nbx(peer->ep(), &plain);
    if (is_request(ptr)) pending_.push_back(Request{ptr, -1, peer});
    else flushed(peer, status_of(ptr));
  }
  last_progress_ = std::chrono::steady_clock::now();
}

void UcxOps::complete(const Request& r, int32_t status) {
  if (r.item < 0) return flushed(r.peer, status);
  const UcxItem& it = items_[r.item];
  if (status != kUcsOk) it.peer->mark_broken();
  else bytes_->fetch_add(it.len, std::memory_order_relaxed);
  batch_->part_done(it.op, status == kUcsOk ? kOk : kPeerClosed, status == kUcsOk ? it.len : 0);
}

void UcxOps::flushed(UcxPeer* peer, int32_t status) {
  if (status != kUcsOk) peer->mark_broken();
  for (const UcxItem& it : items_)
    if (it.write && it.peer.get() == peer) batch_->part_done(it.op, status == kUcsOk ? kOk : kPeerClosed, 0);
}

bool UcxOps::poll() {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock() || pending_.empty()) return false;  // another thread is polling this batch
  std::shared_lock<std::shared_mutex> gate(gate_->mu);
  if (!gate_->open) {
    fail_closed();
    return true;
  }
  bool busy = false;
  for (void* worker : workers_) busy |= g_api.worker_progress(worker) > 0;
  std::vector<std::pair<Request, int32_t>> finished;
  for (size_t i = 0; i < pending_.size();) {
    int32_t status = g_api.request_check_status(pending_[i].ptr);
    if (status == kUcsInProgress) {
      ++i;
      continue;
    }
    g_api.request_free(pending_[i].ptr);
    finished.emplace_back(pending_[i], status);
    pending_[i] = pending_.back();
    pending_.pop_back();
  }
  // Puts before flushes: a write whose put failed is reported as such, not as landed.
  std::stable_partition(finished.begin(), finished.end(), [](const auto& f) { return f.first.item >= 0; });
  for (auto& f : finished) complete(f.first, f.second);
  // Only our own completions count as progress: other traffic on the shared worker must not keep
  // a stopped peer's ops from stalling out.
  auto now = std::chrono::steady_clock::now();
  if (!finished.empty()) last_progress_ = now;
  else if (!pending_.empty() && now - last_progress_ > std::chrono::milliseconds(stall_ms_)) stall();
  return busy || !finished.empty();
}

void UcxOps::stall() {
  // Nothing finished for the stall time: fail what is left. Python then force-closes the broken
  // endpoints, which cancels these requests, and settle() waits until they are over (a stalled
  // peer that resumed was measured landing late bytes of a get otherwise).
  std::vector<Request> left;
  left.swap(pending_);
  for (auto& r : left) {
    r.peer->mark_broken();
    abandoned_.push_back(r.ptr);
  }
  for (auto& r : left) fail(r, kTimeout);
}

void UcxOps::abandon() {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_lock<std::shared_mutex> gate(gate_->mu);
  if (!gate_->open) return fail_closed();
  stall();
}

bool UcxOps::settle(double timeout_s) {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_lock<std::shared_mutex> gate(gate_->mu);
  if (!gate_->open) return false;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    for (size_t i = 0; i < abandoned_.size();) {
      if (g_api.request_check_status(abandoned_[i]) == kUcsInProgress) {
        ++i;
        continue;
      }
      g_api.request_free(abandoned_[i]);
      abandoned_[i] = abandoned_.back();
      abandoned_.pop_back();
    }
    if (abandoned_.empty()) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    for (void* worker : workers_) g_api.worker_progress(worker);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

bool UcxOps::wait(double timeout_s) {
  using clock = std::chrono::steady_clock;
  // Below 0: no deadline (as Batch::wait_events); huge values must not overflow the clock.
  bool forever = timeout_s < 0 || timeout_s > 1e7;
  auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                     std::chrono::duration<double>(forever ? 0.0 : timeout_s));
  auto busy_at = clock::now();
  for (;;) {
    bool busy = poll();
    if (batch_->finished()) return true;
    auto now = clock::now();
    if (!forever && now >= deadline) return false;
    if (busy) {
      busy_at = now;
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (pending_.empty()) break;  // the rest are other routes' parts: wait on their events
    }
    auto idle = now - busy_at;
    if (idle > kSpin)  // idle for a while: let UCX's progress thread (and a local peer) have the CPU
      std::this_thread::sleep_for(std::min<clock::duration>(std::chrono::milliseconds(1), idle / 10));
  }
  if (forever) return batch_->wait_events(-1);
  double left = std::chrono::duration<double>(deadline - clock::now()).count();
  return batch_->wait_events(std::max(0.0, left));
}

}  // namespace kvt
