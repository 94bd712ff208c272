// pybind11 surface of the native data plane. Every call that copies or does I/O releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <poll.h>

#include <chrono>
#include <thread>

#include "engine.h"
#include "index_probe.h"

namespace py = pybind11;
using kvt::Batch;
using kvt::BatchPtr;
using kvt::Engine;

namespace {

constexpr size_t kOpFields = 7;  // opcode, route, local_region, local_off, remote_region, remote_off, len

std::vector<kvt::OpSpec> parse_ops(const py::buffer& flat) {
  py::buffer_info info = flat.request();
  if (info.itemsize != 8 || info.ndim != 1 || (info.shape[0] % kOpFields) != 0)
    throw py::value_error("ops must be a flat uint64 buffer of 7 fields per op");
  auto* v = static_cast<const uint64_t*>(info.ptr);
  size_t n = static_cast<size_t>(info.shape[0]) / kOpFields;
  std::vector<kvt::OpSpec> ops(n);
  for (size_t i = 0; i < n; ++i, v += kOpFields) {
    ops[i] = kvt::OpSpec{static_cast<uint8_t>(v[0]), static_cast<uint32_t>(v[1]), v[2], v[3], v[4], v[5], v[6]};
  }
  return ops;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvstore transfer engine data plane";

  kvt::add_index_probe(m);

  m.def("ucx_load", [](const std::string& path) {
    std::string err;
    if (!kvt::ucx_load(path, &err)) throw std::runtime_error(err);
  }, py::arg("libucp_path"), "Resolve the UCX calls of the ucx route from libucp (the copy ucxx loaded).");

  m.def("wait_readable", [](int fd, double spin_s) {
    py::gil_scoped_release nogil;
    auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(spin_s);
    pollfd p{fd, POLLIN, 0};
    do {
      if (::poll(&p, 1, 0) != 0) return true;  // readable, closed or an error: the caller's recv says which
      std::this_thread::yield();  // whatever else is runnable on this vCPU (the peer, etcd) goes first
    } while (std::chrono::steady_clock::now() < until);
    return false;
  }, py::arg("fd"), py::arg("spin_s"),
     "Poll `fd` without the GIL for up to spin_s seconds; whether it became readable. A reply due within "
     "microseconds is met awake: waking a parked thread on an idle vCPU costs tens of microseconds.");

  m.def("buffer_address", [](const py::buffer& b) {
    py::buffer_info info = b.request();
    return py::make_tuple(reinterpret_cast<uintptr_t>(info.ptr), info.size * info.itemsize, info.readonly);
  }, "(address, nbytes, readonly) of an object exporting the buffer protocol.");

  py::class_<Batch, BatchPtr>(m, "Batch")
      .def("wait", [](Batch& b, double timeout_s) {
        py::gil_scoped_release nogil;
        return b.wait(timeout_s);
      }, py::arg("timeout_s"))
      .def("done", [](Batch& b) {
        py::gil_scoped_release nogil;  // may progress UCX once
        return b.done();
      })
      .def("__len__", &Batch::size)
      .def("abandon", [](Batch& b) {
        py::gil_scoped_release nogil;
        b.abandon();
      }, "The caller gives up on the batch (timed out): its ucx ops fail as stalled.")
      .def("settle", [](Batch& b, double timeout_s) {
        py::gil_scoped_release nogil;
        return b.settle(timeout_s);
      }, py::arg("timeout_s"), "After a failure: wait until cancelled ucx requests are over.")
      .def("wait_failures", [](Batch& b, double timeout_s) -> long {
        py::gil_scoped_release nogil;
        return b.wait(timeout_s) ? b.failures() : -1;
      }, py::arg("timeout_s"), "wait, then the number of failed ops (-1: not done in time): one call on the hot path.")
      .def("failures", &Batch::failures, "Ops not (yet) done and ok: 0 once a batch fully succeeded.")
      .def("statuses", [](const Batch& b) {
        std::vector<int32_t> out(b.size());
        for (size_t i = 0; i < b.size(); ++i) out[i] = b.status(i);
        return out;
      })
      .def("byte_counts", [](const Batch& b) {
        std::vector<uint64_t> out(b.size());
        for (size_t i = 0; i < b.size(); ++i) out[i] = b.bytes(i);
        return out;
      });

  py::class_<Engine>(m, "Engine")
      .def(py::init<uint64_t, uint64_t, int, uint64_t>(), py::arg("stall_ms"), py::arg("stripe_bytes"),
           py::arg("local_workers"), py::arg("bounce_limit"))
      .def("register_memory", &Engine::register_memory, py::arg("address"), py::arg("size"),
           py::arg("readonly"), py::arg("remote_access"), py::arg("remote_writes") = 0,
           "remote_writes: 0 any authenticated peer, 1 only inside ranges granted to it, 2 no remote peer.")
      .def("register_file", [](Engine& e, const std::string& path, uint64_t size, bool readonly, bool remote,
                               uint8_t remote_writes) {
        std::string err;
        uint64_t id;
        {
          py::gil_scoped_release nogil;
          id = e.register_file(path, size, readonly, remote, &err, remote_writes);
        }
        if (id == 0) throw std::runtime_error(err);
        return id;
      }, py::arg("path"), py::arg("size"), py::arg("readonly"), py::arg("remote_access"), py::arg("remote_writes") = 0)
      .def("unregister", [](Engine& e, uint64_t id, double wait_s) {
        py::gil_scoped_release nogil;
        return e.unregister(id, wait_s);
      })
      .def("add_peer", [](Engine& e, const std::vector<int>& fds, const std::vector<std::pair<py::bytes, py::bytes>>& keys) {
        std::vector<kvt::WireKeys> wire;
        for (auto& k : keys) wire.push_back(kvt::WireKeys{std::string(k.first), std::string(k.second)});
        py::gil_scoped_release nogil;
        return e.add_peer(fds, wire);
      }, py::arg("fds"), py::arg("keys"), "keys: (tx, rx) 32-byte keys per fd, or [] for plaintext streams.")
      .def("peer_alive", &Engine::peer_alive)
      .def("peer_stream_bytes", &Engine::peer_stream_bytes, "Payload bytes each stream to the peer carried.")
      .def("released", &Engine::released, "After a timed-out unregister: no op holds the region any more.")
      .def("serving", &Engine::serving, "Data connections being served now.")
      .def("remove_peer", [](Engine& e, uint32_t id) {
        py::gil_scoped_release nogil;
        e.remove_peer(id);
      })
      .def("serve", [](Engine& e, int fd, const py::bytes& tx, const py::bytes& rx, const std::string& peer) {
        kvt::WireKeys keys{std::string(tx), std::string(rx)};
        py::gil_scoped_release nogil;
        e.serve(fd, keys, peer);
      }, py::arg("fd"), py::arg("tx"), py::arg("rx"), py::arg("peer") = "",
         "Serve a data connection of the peer identity `peer` (its grants apply; \"\": none).")
      .def("grant", &Engine::grant, py::arg("peer"), py::arg("region"), py::arg("offset"), py::arg("length"),
           "Let `peer` write [offset, offset+length) of a granted region; False when it overlaps one of its grants.")
      .def("revoke", &Engine::revoke, py::arg("peer"), py::arg("region"), py::arg("offset"), py::arg("length"),
           "Drop `peer`'s grants overlapping the range; True when none of its writes is still landing there.")
      .def("landing", &Engine::landing, py::arg("peer"), py::arg("region"), py::arg("offset"), py::arg("length"),
           "Whether a write of `peer` under a revoked grant is still landing in the range.")
      .def("add_ucx_peer", &Engine::add_ucx_peer, py::arg("worker"), py::arg("ep"), py::arg("watch_fd"),
           "A ucx route over a ucxx endpoint (handles stay owned by Python); returns its route id. watch_fd: "
           "the peer's control socket when UCX cannot detect the peer's death itself, else -1.")
      .def("ucx_key", [](Engine& e, uint32_t route, uint64_t region, uint64_t addr, uint64_t size, uintptr_t rkey,
                         bool readonly) {
        e.ucx_key(route, region, kvt::UcxKey{addr, size, reinterpret_cast<void*>(rkey), readonly});
      }, py::arg("route"), py::arg("region"), py::arg("addr"), py::arg("size"), py::arg("rkey"), py::arg("readonly"))
      .def("ucx_broken", &Engine::ucx_broken, "ucx routes whose ops failed or stalled.")
      .def("set_ucx_memh", &Engine::set_ucx_memh, py::arg("region"), py::arg("memh"), py::arg("cuda"),
           py::arg("address"), "The region's UCX mapping: memory handle, memory type and mapped address.")
      .def("remove_ucx_peer", [](Engine& e, uint32_t route) {
        py::gil_scoped_release nogil;  // waits out batches issuing ops on it
        e.remove_ucx_peer(route);
      })
      .def("submit", [](Engine& e, const py::buffer& flat) {
        std::vector<kvt::OpSpec> ops = parse_ops(flat);
        py::gil_scoped_release nogil;
        return e.submit(ops);
      }, py::arg("ops"), "Start the ops.")
      .def("run", [](Engine& e, const py::buffer& flat, double timeout_s) {
        std::vector<kvt::OpSpec> ops = parse_ops(flat);
        BatchPtr batch;
        long failures = 0;
        {
          py::gil_scoped_release nogil;
          batch = e.submit(ops);
          failures = batch->wait(timeout_s) ? batch->failures() : -1;
        }
        return py::make_tuple(failures, failures ? py::cast(batch) : py::none());
      }, py::arg("ops"), py::arg("timeout_s"),
         "submit + wait in one call: (failed ops, or -1 when not done in time; the batch when not 0).")
      .def("stats", &Engine::stats)
      .def("close", [](Engine& e) {
        py::gil_scoped_release nogil;
        e.close();
      });
}
