// The native engine: region table, TCP peers, served connections and a worker pool for local
// copies (memory, files, mapped shared memory of same-host peers). Python drives it; it never
// calls back into Python.
#pragma once

#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "aead.h"
#include "common.h"
#include "grants.h"
#include "tcp.h"
#include "ucx.h"

namespace kvt {

class WorkerPool {
 public:
  explicit WorkerPool(int n);
  ~WorkerPool();
  int size() const { return static_cast<int>(threads_.size()); }
  void post(std::function<void()> task);
  void stop();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::vector<std::thread> threads_;
  bool stopping_ = false;
};

constexpr uint32_t kUcxRoute = 1u << 31;

class Engine {
 public:
  Engine(uint64_t stall_ms, uint64_t stripe_bytes, int local_workers, uint64_t bounce_limit);
  ~Engine();

  // remote_writes: RemoteWrites (grants.h), who may write the region over a data connection.
  uint64_t register_memory(uintptr_t ptr, uint64_t size, bool readonly, bool remote_access,
                           uint8_t remote_writes = kWritesAny);
  // Returns 0 and sets err on failure.
  uint64_t register_file(const std::string& path, uint64_t size, bool readonly, bool remote_access,
                         std::string* err, uint8_t remote_writes = kWritesAny);
  bool unregister(uint64_t id, double wait_s);  // false: ops still hold it after wait_s
  bool released(uint64_t id);  // after a timed-out unregister: true once no op holds the region

  uint32_t add_peer(const std::vector<int>& fds, const std::vector<WireKeys>& keys);
  bool peer_alive(uint32_t id);
  std::vector<uint64_t> peer_stream_bytes(uint32_t id);
  void remove_peer(uint32_t id);
  // Serve an authenticated data connection of the peer whose handshake named `peer` (its writes
  // into granted regions are checked against that identity's grants; "" has none).
  void serve(int fd, const WireKeys& keys, const std::string& peer = "");
  int serving() const;  // data connections being served now

  // Write grants of regions registered kWritesGranted (see grants.h).
  bool grant(const std::string& peer, uint64_t region, uint64_t offset, uint64_t len) {
    return grants_.grant(peer, region, offset, len);
  }
  bool revoke(const std::string& peer, uint64_t region, uint64_t offset, uint64_t len) {
    return grants_.revoke(peer, region, offset, len);
  }
  bool landing(const std::string& peer, uint64_t region, uint64_t offset, uint64_t len) {
    return grants_.landing(peer, region, offset, len);
  }

  // The ucx route: Python's ucxx endpoint on `worker`; route ids have kUcxRoute set.
  uint32_t add_ucx_peer(uintptr_t worker, uintptr_t ep, int watch_fd);
  void ucx_key(uint32_t route, uint64_t region, const UcxKey& key);
  void remove_ucx_peer(uint32_t route);
  std::vector<uint32_t> ucx_broken();  // routes whose ops failed or stalled: Python retires them
  bool set_ucx_memh(uint64_t region, uintptr_t memh, bool cuda, uintptr_t address);

  BatchPtr submit(const std::vector<OpSpec>& ops);
  std::map<std::string, uint64_t> stats() const;
  void close();

 private:
  struct Piece {
    uint32_t op;
    RegionPtr dst, src;
    uint64_t dst_off, src_off, len;
  };
  // Served connections run on detached threads that close their own fd when they end; the
  // state lives in a shared_ptr so a thread finishing during ~Engine never touches freed memory.
  struct Conns {
    std::mutex mu;
    std::condition_variable cv;
    std::set<int> fds;
    int active = 0;
  };
  void run_pieces(const BatchPtr& batch, std::vector<Piece>& pieces, uint64_t total);
  int32_t plan_ucx(const OpSpec& op, uint32_t index, const RegionPtr& local, std::vector<UcxItem>* out,
                   std::vector<UcxPeer*>* checked);
  void stop_connections();

  uint64_t stall_ms_, stripe_bytes_;
  RegionTable regions_;
  Counters counters_;
  std::mutex peers_mu_;
  std::map<uint32_t, std::shared_ptr<Peer>> peers_;
  uint32_t next_peer_ = 1;
  std::map<uint32_t, UcxPeerPtr> ucx_peers_;  // under peers_mu_
  UcxGatePtr ucx_gate_ = std::make_shared<UcxGate>();
  uint32_t next_ucx_ = 1;
  std::shared_ptr<Conns> conns_ = std::make_shared<Conns>();
  std::atomic<bool> closing_{false};
  BounceBudget budget_;
  GrantTable grants_;
  std::mutex graveyard_mu_;
  std::map<uint64_t, std::weak_ptr<Region>> graveyard_;  // unregistered while ops held them
  WorkerPool pool_;
};

}  // namespace kvt
