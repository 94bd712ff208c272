// The native engine: region table, TCP peers, served connections and a worker pool for local
// copies (memory, files, mapped shared memory of same-host peers). Python drives it; it never
// calls back into Python.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <thread>

#include "common.h"
#include "tcp.h"

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

class Engine {
 public:
  Engine(uint64_t stall_ms, uint64_t stripe_bytes, int local_workers);
  ~Engine();

  uint64_t register_memory(uintptr_t ptr, uint64_t size, bool readonly, bool remote_access);
  // Returns 0 and sets err on failure.
  uint64_t register_file(const std::string& path, uint64_t size, bool readonly, bool remote_access,
                         std::string* err);
  bool unregister(uint64_t id, double wait_s);  // false: ops still hold it after wait_s

  uint32_t add_peer(const std::vector<int>& fds);
  bool peer_alive(uint32_t id);
  void remove_peer(uint32_t id);
  void serve(int fd);

  BatchPtr submit(const std::vector<OpSpec>& ops);
  std::map<std::string, uint64_t> stats() const;
  void close();

 private:
  struct Piece {
    uint32_t op;
    RegionPtr dst, src;
    uint64_t dst_off, src_off, len;
  };
  struct Conn {
    int fd;
    std::thread thread;
    std::atomic<bool> done{false};
  };
  void run_pieces(const BatchPtr& batch, std::vector<Piece>& pieces, uint64_t total);
  void reap_connections(bool all);

  uint64_t stall_ms_, stripe_bytes_;
  RegionTable regions_;
  Counters counters_;
  std::mutex peers_mu_;
  std::map<uint32_t, std::shared_ptr<Peer>> peers_;
  uint32_t next_peer_ = 1;
  std::mutex conns_mu_;
  std::vector<std::unique_ptr<Conn>> conns_;
  std::atomic<bool> closing_{false};
  WorkerPool pool_;
};

}  // namespace kvt
