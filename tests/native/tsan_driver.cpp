// ThreadSanitizer driver for the native data plane (Python itself cannot run under TSan here):
// two engines joined by real loopback TCP connections, plaintext and AES-GCM streams, memory and
// file regions, concurrent submitters, connections served while the engine closes, write grants
// made and revoked while writes under them land.
//   c++ -O1 -g -fsanitize=thread -std=c++17 -pthread -Icpp tests/native/tsan_driver.cpp \
//       $(ls cpp/*.cpp | grep -v module) -lcrypto -o /tmp/tsan_driver && /tmp/tsan_driver
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "engine.h"

using namespace kvt;

namespace {

// One connected loopback TCP pair: (client fd, server fd).
std::pair<int, int> tcp_pair() {
  int l = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::listen(l, 4);
  socklen_t n = sizeof a;
  ::getsockname(l, reinterpret_cast<sockaddr*>(&a), &n);
  int c = ::socket(AF_INET, SOCK_STREAM, 0);
  ::connect(c, reinterpret_cast<sockaddr*>(&a), sizeof a);
  int s = ::accept(l, nullptr, nullptr);
  ::close(l);
  return {c, s};
}

int failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what);
    ++failures;
  }
}

void run(bool sealed) {
  const uint64_t size = 8 << 20;
  std::vector<uint8_t> owner_mem(size, 0x11), mine(size, 0);
  Engine owner(2000, 256 << 10, 2, 32 << 20), initiator(2000, 256 << 10, 2, 32 << 20);
  uint64_t remote = owner.register_memory(reinterpret_cast<uintptr_t>(owner_mem.data()), size, false, true);
  std::string err;
  char path[] = "/tmp/kvt-tsan-XXXXXX";
  int tmp = ::mkstemp(path);
  ::close(tmp);
  uint64_t file = owner.register_file(path, size, false, true, &err);
  uint64_t local = initiator.register_memory(reinterpret_cast<uintptr_t>(mine.data()), size, false, false);
  std::vector<int> fds;
  std::vector<WireKeys> keys;
  for (int i = 0; i < 4; ++i) {
    auto [c, s] = tcp_pair();
    std::string k1(32, static_cast<char>('a' + i)), k2(32, static_cast<char>('A' + i));
    WireKeys server_keys = sealed ? WireKeys{k2, k1} : WireKeys{};
    owner.serve(s, server_keys);
    fds.push_back(c);
    keys.push_back(sealed ? WireKeys{k1, k2} : WireKeys{});
  }
  uint32_t peer = initiator.add_peer(fds, keys);
  auto worker = [&](int t) {
    for (int round = 0; round < 20; ++round) {
      std::vector<OpSpec> ops;
      uint64_t region = (round % 2) ? file : remote;
      for (uint64_t off = t * (size / 2); off < (t + 1) * (size / 2); off += 1 << 20)
        ops.push_back(OpSpec{static_cast<uint8_t>(round % 3 == 0 ? kWrite : kRead), peer, local, off, region, off,
                             1 << 20});
      ops.push_back(OpSpec{kRead, peer, local, 0, region, size - 10, 100});  // refused: out of bounds
      BatchPtr b = initiator.submit(ops);
      check(b->wait(20), "batch finished");
      for (size_t i = 0; i + 1 < ops.size(); ++i) check(b->status(i) == kOk, "op ok");
      check(b->status(ops.size() - 1) == kOutOfBounds, "refused op");
    }
  };
  std::thread a(worker, 0), b(worker, 1);
  a.join();
  b.join();
  // Close the owner while the initiator keeps submitting and new connections arrive.
  std::thread submitter([&] {
    for (int i = 0; i < 50; ++i) {
      std::vector<OpSpec> ops{OpSpec{kRead, peer, local, 0, remote, 0, 1 << 16}};
      initiator.submit(ops)->wait(5);
    }
  });
  std::thread connector([&] {
    for (int i = 0; i < 20; ++i) {
      auto [c, s] = tcp_pair();
      owner.serve(s, WireKeys{});
      ::close(c);
    }
  });
  owner.close();
  submitter.join();
  connector.join();
  initiator.close();
  ::unlink(path);
}

// Write grants checked on the serving threads while another thread grants and revokes them.
void run_grants(bool sealed) {
  const uint64_t size = 8 << 20, piece = 1 << 20;
  std::vector<uint8_t> owner_mem(size, 0x11), mine(size, 0x22);
  Engine owner(2000, 256 << 10, 2, 32 << 20), initiator(2000, 256 << 10, 2, 32 << 20);
  uint64_t remote =
      owner.register_memory(reinterpret_cast<uintptr_t>(owner_mem.data()), size, false, true, kWritesGranted);
  uint64_t local = initiator.register_memory(reinterpret_cast<uintptr_t>(mine.data()), size, false, false);
  std::vector<int> fds;
  std::vector<WireKeys> keys;
  for (int i = 0; i < 4; ++i) {
    auto [c, s] = tcp_pair();
    std::string k1(32, static_cast<char>('a' + i)), k2(32, static_cast<char>('A' + i));
    owner.serve(s, sealed ? WireKeys{k2, k1} : WireKeys{}, "writer");
    fds.push_back(c);
    keys.push_back(sealed ? WireKeys{k1, k2} : WireKeys{});
  }
  uint32_t peer = initiator.add_peer(fds, keys);
  std::atomic<bool> done{false};
  std::thread granter([&] {
    for (int round = 0; !done.load(); ++round) {
      uint64_t off = (round % 8) * piece;
      check(owner.grant("writer", remote, off, piece), "grant");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (!owner.revoke("writer", remote, off, piece)) {
        while (owner.landing("writer", remote, off, piece)) std::this_thread::yield();
      }
    }
  });
  auto worker = [&](int t) {
    for (int round = 0; round < 40; ++round) {
      std::vector<OpSpec> ops;
      for (uint64_t off = t * (size / 2); off < (t + 1) * (size / 2); off += piece)
        ops.push_back(OpSpec{kWrite, peer, local, off, remote, off, piece});
      BatchPtr b = initiator.submit(ops);
      check(b->wait(20), "granted batch finished");
      for (size_t i = 0; i < ops.size(); ++i) check(b->status(i) == kOk || b->status(i) == kNotGranted, "op granted or refused");
    }
  };
  std::thread a(worker, 0), b(worker, 1);
  a.join();
  b.join();
  done = true;
  granter.join();
  std::vector<OpSpec> refused{OpSpec{kWrite, peer, local, 0, remote, 0, 4096}};
  BatchPtr r = initiator.submit(refused);
  check(r->wait(5) && r->status(0) == kNotGranted, "write after every revoke refused");
  check(owner.grant("writer", remote, 0, 4096), "grant again");
  BatchPtr g = initiator.submit(refused);
  check(g->wait(5) && g->status(0) == kOk, "granted write lands");
  owner.close();
  initiator.close();
}

}  // namespace

int main() {
  run(false);
  run(true);
  run_grants(false);
  run_grants(true);
  std::printf("tsan driver done: %d failures\n", failures);
  return failures ? 1 : 0;
}
