#include "grants.h"

#include <algorithm>

namespace kvt {

namespace {
bool overlaps(const Grant& g, uint64_t region, uint64_t offset, uint64_t end) {
  return g.region == region && g.offset < end && offset < g.end;
}
}  // namespace

Grant* GrantSet::find(uint64_t region, uint64_t offset, uint64_t len) const {
  auto it = grants_.upper_bound(Key{region, offset});  // the first grant starting after `offset`
  if (it == grants_.begin()) return nullptr;
  const Grant& g = *std::prev(it)->second;  // the last one starting at or before it
  if (g.region != region || offset > g.end || len > g.end - offset) return nullptr;
  return std::prev(it)->second.get();
}

bool GrantSet::add(uint64_t region, uint64_t offset, uint64_t len) {
  if (len == 0 || offset + len < offset) return false;
  const uint64_t end = offset + len;
  std::lock_guard<std::mutex> lock(mu_);
  auto next = grants_.lower_bound(Key{region, offset});
  if (next != grants_.end() && overlaps(*next->second, region, offset, end)) return false;
  if (next != grants_.begin() && overlaps(*std::prev(next)->second, region, offset, end)) return false;
  auto grant = std::make_unique<Grant>();
  grant->region = region;
  grant->offset = offset;
  grant->end = end;
  grants_.emplace_hint(next, Key{region, offset}, std::move(grant));
  return true;
}

bool GrantSet::revoke(uint64_t region, uint64_t offset, uint64_t len) {
  const uint64_t end = len > UINT64_MAX - offset ? UINT64_MAX : offset + len;
  bool quiet = true;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = grants_.lower_bound(Key{region, offset});
  if (it != grants_.begin() && overlaps(*std::prev(it)->second, region, offset, end)) --it;
  while (it != grants_.end() && overlaps(*it->second, region, offset, end)) {
    if (it->second->landing) {  // kept alive for the write still copying into it
      it->second->revoked = true;
      revoked_.push_back(std::move(it->second));
      quiet = false;
    }
    it = grants_.erase(it);
  }
  return quiet;
}

bool GrantSet::landing(uint64_t region, uint64_t offset, uint64_t len) const {
  const uint64_t end = len > UINT64_MAX - offset ? UINT64_MAX : offset + len;
  std::lock_guard<std::mutex> lock(mu_);
  return std::any_of(revoked_.begin(), revoked_.end(),
                     [&](const std::unique_ptr<Grant>& g) { return overlaps(*g, region, offset, end); });
}

bool GrantSet::covers(uint64_t region, uint64_t offset, uint64_t len) const {
  std::lock_guard<std::mutex> lock(mu_);
  return find(region, offset, len) != nullptr;
}

Grant* GrantSet::claim(uint64_t region, uint64_t offset, uint64_t len) {
  std::lock_guard<std::mutex> lock(mu_);
  Grant* g = find(region, offset, len);
  if (g) ++g->landing;
  return g;
}

void GrantSet::release(Grant* grant) {
  std::lock_guard<std::mutex> lock(mu_);
  if (--grant->landing == 0 && grant->revoked) {
    revoked_.erase(std::find_if(revoked_.begin(), revoked_.end(),
                                [grant](const std::unique_ptr<Grant>& g) { return g.get() == grant; }));
  }
}

bool GrantSet::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return grants_.empty() && revoked_.empty();
}

size_t GrantSet::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return grants_.size();
}

GrantSetPtr GrantTable::attach(const std::string& peer) {
  std::lock_guard<std::mutex> lock(mu_);
  GrantSetPtr& set = sets_[peer];
  if (!set) set = std::make_shared<GrantSet>();
  return set;
}

void GrantTable::detach(GrantSetPtr& set, const std::string& peer) {
  std::lock_guard<std::mutex> lock(mu_);
  set.reset();
  drop_if_idle(peer);
}

void GrantTable::drop_if_idle(const std::string& peer) {
  auto it = sets_.find(peer);
  // use_count changes only under mu_ (attach, detach): 1 means no connection holds the set.
  if (it != sets_.end() && it->second.use_count() == 1 && it->second->idle()) sets_.erase(it);
}

bool GrantTable::grant(const std::string& peer, uint64_t region, uint64_t offset, uint64_t len) {
  std::lock_guard<std::mutex> lock(mu_);
  GrantSetPtr& set = sets_[peer];
  if (!set) set = std::make_shared<GrantSet>();
  bool ok = set->add(region, offset, len);
  if (!ok) drop_if_idle(peer);
  return ok;
}

bool GrantTable::revoke(const std::string& peer, uint64_t region, uint64_t offset, uint64_t len) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sets_.find(peer);
  if (it == sets_.end()) return true;
  bool quiet = it->second->revoke(region, offset, len);
  drop_if_idle(peer);
  return quiet;
}

bool GrantTable::landing(const std::string& peer, uint64_t region, uint64_t offset, uint64_t len) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sets_.find(peer);
  bool busy = it != sets_.end() && it->second->landing(region, offset, len);
  if (!busy) drop_if_idle(peer);
  return busy;
}

uint64_t GrantTable::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t n = 0;
  for (auto& kv : sets_) n += kv.second->size();
  return n;
}

}  // namespace kvt
