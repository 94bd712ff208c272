// The ucx route's data path: one-sided put/get on UCX endpoints that Python (ucxx) created and
// wired up, driven here without the GIL. libucp is opened at run time (the ucx extra is optional,
// so nothing here needs UCX's headers at build time): ucx_load() resolves the few calls we use.
#pragma once

#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.h"

namespace kvt {

// Loads libucp (the copy ucxx already loaded) once; false and *err when a call is missing.
bool ucx_load(const std::string& libucp_path, std::string* err);
bool ucx_loaded();

// A peer region's RMA key as this endpoint unpacked it.
struct UcxKey {
  uint64_t addr = 0, size = 0;
  void* rkey = nullptr;
  bool readonly = false;
  bool contains(uint64_t off, uint64_t len) const { return off <= size && len <= size - off; }
};

// One peer's endpoint (owned by Python) and the keys it advertised. Once an op on it fails or
// stalls it is marked broken; Python then retires the endpoint (force close) and uses TCP.
class UcxPeer {
 public:
  // watch_fd: the peer's control socket (duplicated here) when UCX cannot see the peer die (no
  // peer-failure handling): ops check it once a batch instead. -1 otherwise.
  UcxPeer(void* worker, void* ep, int watch_fd);
  ~UcxPeer();
  bool gone() const;  // the watched control socket says the peer exited
  void set_key(uint64_t region, const UcxKey& key);
  bool key(uint64_t region, UcxKey* out);
  void* worker() const { return worker_; }
  void* ep() const { return ep_; }
  void mark_broken() { broken_.store(true, std::memory_order_release); }
  bool broken() const { return broken_.load(std::memory_order_acquire); }
  // Issuing ops holds `use` shared; retire() takes it exclusively, so once it returns no op is
  // being issued on the endpoint and none will be: Python may close it and destroy its rkeys.
  std::shared_mutex use;
  bool retired = false;  // under `use`
  void retire();

 private:
  void* worker_;
  void* ep_;
  int watch_fd_;
  std::mutex mu_;
  std::unordered_map<uint64_t, UcxKey> keys_;
  std::atomic<bool> broken_{false};
};
using UcxPeerPtr = std::shared_ptr<UcxPeer>;

// Whether UCX may still be called: closed by the engine before Python destroys the worker. Calls
// into UCX hold it shared, so close() waits for those in progress.
struct UcxGate {
  std::shared_mutex mu;
  bool open = true;
};
using UcxGatePtr = std::shared_ptr<UcxGate>;

// One op on the ucx route, checked against the local region and the peer's key.
struct UcxItem {
  uint32_t op;
  bool write;
  UcxPeerPtr peer;
  RegionPtr local;  // held so unregister waits for the op
  uint8_t* local_addr;
  uint64_t remote_addr, len;
  void* rkey;
};

// The UCX share of a batch: issues every put/get, then one flush per endpoint written to (a put
// completes locally before its bytes land; a write is reported done only after its flush), and
// completes the batch's ops as requests finish. A write has two parts: its put and its flush.
class UcxOps : public Poller {
 public:
  // Once `gate` closed (the engine closed; Python then destroys the UCX worker) this object never
  // calls into UCX again: its ops fail, its requests are left to the worker's end.
  UcxOps(Batch* batch, std::vector<UcxItem> items, uint64_t stall_ms, std::atomic<uint64_t>* bytes,
         UcxGatePtr gate);
  ~UcxOps() override;
  void start();
  bool poll() override;
  bool wait(double timeout_s) override;
  bool settle(double timeout_s) override;
  void abandon() override;

 private:
  struct Request {
    void* ptr;
    int32_t item;  // index into items_, or -1 for a flush
    UcxPeer* peer;
  };
  void complete(const Request& r, int32_t ucs_status);
  void flushed(UcxPeer* peer, int32_t status);
  void fail(const Request& r, int32_t status);  // the parts `r` stood for, failed with `status`
  void stall();
  void fail_closed();

  Batch* batch_;  // owns this object
  std::vector<UcxItem> items_;
  uint64_t stall_ms_;
  std::atomic<uint64_t>* bytes_;
  UcxGatePtr gate_;
  std::mutex mu_;  // poll() runs from any thread that waits on or polls the batch
  std::vector<Request> pending_;
  std::vector<void*> abandoned_;  // stalled requests, released with the batch
  std::vector<void*> workers_;
  std::chrono::steady_clock::time_point last_progress_;
};

}  // namespace kvt
