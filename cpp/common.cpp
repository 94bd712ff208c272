#include "common.h"

#include <unistd.h>

#include <thread>

namespace kvt {

Region::~Region() {
  if (fd >= 0) ::close(fd);
  if (direct_fd >= 0) ::close(direct_fd);
}

uint64_t RegionTable::add(RegionPtr r) {
  std::lock_guard<std::mutex> lock(mu_);
  r->id = next_id_++;
  regions_[r->id] = r;
  return r->id;
}

RegionPtr RegionTable::get(uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(id);
  return it == regions_.end() ? nullptr : it->second;
}

RegionPtr RegionTable::remove(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return nullptr;
  RegionPtr r = it->second;
  regions_.erase(it);
  return r;
}

std::vector<RegionPtr> RegionTable::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RegionPtr> all;
  for (auto& kv : regions_) all.push_back(kv.second);
  regions_.clear();
  return all;
}

Batch::Batch(size_t n)
    : n_(n),
      status_(new std::atomic<int32_t>[n]),
      bytes_(new std::atomic<uint64_t>[n]),
      parts_(new std::atomic<uint32_t>[n]),
      remaining_(n) {
  for (size_t i = 0; i < n; ++i) {
    status_[i].store(kPending, std::memory_order_relaxed);
    bytes_[i].store(0, std::memory_order_relaxed);
    parts_[i].store(1, std::memory_order_relaxed);
  }
}

void Batch::part_done(size_t op, int32_t status, uint64_t nbytes) {
  if (status != kOk) {
    int32_t expected = kPending;
    status_[op].compare_exchange_strong(expected, status, std::memory_order_acq_rel);
  } else {
    bytes_[op].fetch_add(nbytes, std::memory_order_relaxed);
  }
  if (parts_[op].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  int32_t expected = kPending;
  status_[op].compare_exchange_strong(expected, kOk, std::memory_order_acq_rel);
  if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_all();
  }
}

bool Batch::wait(double timeout_s) {
  if (poller_) return poller_->wait(timeout_s);
  return wait_events(timeout_s);
}

bool Batch::wait_events(double timeout_s) {
  // Spin briefly before sleeping: a waiter that parks lets its vCPU idle, and waking an idle vCPU
  // costs tens of microseconds, more than a small transfer takes on loopback.
  auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
  while (!done() && std::chrono::steady_clock::now() < spin_until) std::this_thread::yield();
  if (done()) return true;
  std::unique_lock<std::mutex> lock(mu_);
  auto is_done = [this] { return remaining_.load(std::memory_order_acquire) == 0; };
  if (timeout_s < 0) {
    cv_.wait(lock, is_done);
    return true;
  }
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), is_done);
}

}  // namespace kvt
