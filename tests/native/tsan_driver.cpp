// ThreadSanitizer driver for the native data plane (Python itself cannot run under TSan here):
// two engines joined by real loopback TCP connections, plaintext and AES-GCM streams, memory and
// file regions, concurrent submitters, connections served while the engine closes.
//   c++ -O1 -g -fsanitize=thread -std=c++17 -pthread -Icpp tests/native/tsan_driver.cpp \
//       $(ls cpp/*.cpp | grep -v module) -lcrypto -o /tmp/tsan_driver && /tmp/tsan_driver
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

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

}  // namespace

int main() {
  run(false);
  run(true);
  std::printf("tsan driver done: %d failures\n", failures);
  return failures ? 1 : 0;
}
