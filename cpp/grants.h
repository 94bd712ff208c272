// Write grants: the byte ranges of regions registered "granted" that one remote peer may write.
// Python grants and revokes (policy); the serving side of a data connection checks every write op
// against its peer's grants (bytes). A peer is named by the identity its handshake carried.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace kvt {

// Who may write a region from the outside (remote peers over TCP; local copies are the owner's own).
enum RemoteWrites : uint8_t {
  kWritesAny = 0,      // any authenticated peer, anywhere in the region
  kWritesGranted = 1,  // only inside ranges granted to that peer
  kWritesNone = 2,     // no remote peer (read-only to them)
};

struct Grant {
  uint64_t region = 0, offset = 0, end = 0;
  uint32_t landing = 0;  // writes being copied into the range now (under GrantSet::mu_)
  bool revoked = false;
};

// The grants of one peer identity: disjoint ranges, looked up in O(log n) per op.
class GrantSet {
 public:
  bool add(uint64_t region, uint64_t offset, uint64_t len);  // false: overlaps a grant it holds
  // Drops every grant overlapping the range. True when no write is still landing in them: from
  // now on no byte of this peer lands there. False: one still is (landing() says when it is over).
  bool revoke(uint64_t region, uint64_t offset, uint64_t len);
  bool landing(uint64_t region, uint64_t offset, uint64_t len) const;  // a revoked grant's write still lands
  bool covers(uint64_t region, uint64_t offset, uint64_t len) const;
  // A write of [offset, offset+len) starts landing: the grant that holds all of it, its `landing`
  // count raised (revoke cannot finish quietly until release), or nullptr (not granted).
  Grant* claim(uint64_t region, uint64_t offset, uint64_t len);
  void release(Grant* grant);
  bool idle() const;  // no grant and nothing landing
  size_t size() const;

 private:
  using Key = std::pair<uint64_t, uint64_t>;  // (region, offset)
  Grant* find(uint64_t region, uint64_t offset, uint64_t len) const;  // caller holds mu_
  mutable std::mutex mu_;
  std::map<Key, std::unique_ptr<Grant>> grants_;
  std::vector<std::unique_ptr<Grant>> revoked_;  // revoked while writes were landing in them
};
using GrantSetPtr = std::shared_ptr<GrantSet>;

// Every peer identity's grants. Serving connections attach to their peer's set for their lifetime,
// so grants made after a connection was accepted reach it; an idle set nobody holds is dropped.
class GrantTable {
 public:
  GrantSetPtr attach(const std::string& peer);
  void detach(GrantSetPtr& set, const std::string& peer);
  bool grant(const std::string& peer, uint64_t region, uint64_t offset, uint64_t len);
  bool revoke(const std::string& peer, uint64_t region, uint64_t offset, uint64_t len);
  bool landing(const std::string& peer, uint64_t region, uint64_t offset, uint64_t len);
  uint64_t count() const;  // grants held, all peers

 private:
  void drop_if_idle(const std::string& peer);  // caller holds mu_
  mutable std::mutex mu_;  // taken before a set's own lock, never after it
  std::map<std::string, GrantSetPtr> sets_;
};

// A write's hold on its grant while its bytes are copied in (released when it goes out of scope).
class Landing {
 public:
  Landing() = default;
  Landing(const Landing&) = delete;
  Landing& operator=(const Landing&) = delete;
  ~Landing() { done(); }
  bool claim(GrantSet* set, uint64_t region, uint64_t offset, uint64_t len) {
    set_ = set;
    grant_ = set ? set->claim(region, offset, len) : nullptr;
    return grant_ != nullptr;
  }
  void done() {
    if (grant_) set_->release(grant_);
    grant_ = nullptr;
  }

 private:
  GrantSet* set_ = nullptr;
  Grant* grant_ = nullptr;
};

}  // namespace kvt
