// match() of the index mirror (kvstore/index_table.py): how many leading hashes of a prompt its hash
// index holds, and their placement ids. With numpy, joining 4,096 hashes into one buffer and the
// gathers cost about 95 us before any comparison, and every block was probed even when the prompt
// left the index at its first; this reads each hash straight from its bytes object, stops at the
// first absent block, and prefetches rows a few blocks ahead so their cache misses overlap.
//
// The GIL stays held: the hashes and the overflow dict are Python objects, and a whole 4,096-block
// probe (tens of us) is shorter than taking the GIL back after a release can be (up to the 5 ms
// switch interval while another thread runs Python). The caller holds the table's lock, so no row
// changes underneath.
#include "index_probe.h"

#include <atomic>
#include <cstdint>
#include <cstring>

namespace py = pybind11;

namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "index rows hold little-endian u64 keys");

constexpr size_t kRowBytes = 20;  // packed (k0 u64, k1 u64, pid i32): index_table._ROW
constexpr size_t kHashBytes = 16;
constexpr size_t kAhead = 16;     // prefetch distance in blocks: enough misses in flight to cover DRAM latency

struct Level {
  const uint8_t* rows;
  uint64_t mask;  // slots - 1; a level's slot count is a power of two
  bool by_k1;     // level 0 is addressed by the hash's first 8 bytes, level 1 by its last 8

  const uint8_t* row(const uint64_t key[2]) const { return rows + ((by_k1 ? key[1] : key[0]) & mask) * kRowBytes; }

  void prefetch(const uint64_t key[2]) const {
    const uint8_t* r = row(key);
    __builtin_prefetch(r);
    __builtin_prefetch(r + kRowBytes - 1);  // a row may straddle two cache lines
  }

  // The placement id stored for `key`, or -1. A slot is live iff its pid >= 0.
  int32_t find(const uint64_t key[2]) const {
    const uint8_t* r = row(key);
    uint64_t k[2];
    int32_t pid;
    std::memcpy(k, r, sizeof k);
    std::memcpy(&pid, r + sizeof k, sizeof pid);
    return (pid >= 0 && k[0] == key[0] && k[1] == key[1]) ? pid : -1;
  }
};

Level level_of(const py::buffer& buf, bool by_k1, py::buffer_info& info) {
  info = buf.request();
  auto slots = static_cast<uint64_t>(info.shape.empty() ? 0 : info.shape[0]);
  if (info.ndim != 1 || info.itemsize != static_cast<py::ssize_t>(kRowBytes) ||
      info.strides[0] != static_cast<py::ssize_t>(kRowBytes) || slots == 0 || (slots & (slots - 1)) != 0)
    throw py::value_error("an index level must be a contiguous power-of-two array of 20-byte rows");
  return Level{static_cast<const uint8_t*>(info.ptr), slots - 1, by_k1};
}

// The 16 bytes of a hash: bytes (or a subclass), a bytearray or a memoryview. Anything else is
// refused (never an indexed hash), as is any type whose buffer export could run Python code and
// mutate `hashes` under the probe.
bool key_of(PyObject* item, uint64_t key[2]) {
  if (PyBytes_Check(item)) {
    if (PyBytes_GET_SIZE(item) != static_cast<Py_ssize_t>(kHashBytes)) return false;
    std::memcpy(key, PyBytes_AS_STRING(item), kHashBytes);
    return true;
  }
  if (!PyByteArray_CheckExact(item) && !PyMemoryView_Check(item)) return false;
  Py_buffer view;
  if (PyObject_GetBuffer(item, &view, PyBUF_C_CONTIGUOUS) != 0) {  // a released or strided view
    PyErr_Clear();
    return false;
  }
  bool ok = view.len == static_cast<Py_ssize_t>(kHashBytes);
  if (ok) std::memcpy(key, view.buf, kHashBytes);
  PyBuffer_Release(&view);
  return ok;
}

// A hash found in neither level may have spilled to the overflow dict (hash bytes -> pid).
int32_t spilled(const py::dict& overflow, PyObject* item, const uint64_t key[2]) {
  if (overflow.empty()) return -1;
  // The item itself when it is plain bytes (its hash is cached); else plain bytes of the same value,
  // so no user-defined __hash__ or __eq__ runs.
  py::object h = PyBytes_CheckExact(item) ? py::reinterpret_borrow<py::object>(item)
                                          : py::bytes(reinterpret_cast<const char*>(key), kHashBytes);
  PyObject* pid = PyDict_GetItemWithError(overflow.ptr(), h.ptr());  // borrowed
  if (pid == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return -1;
  }
  return py::cast<int32_t>(py::handle(pid));
}

size_t index_prefix(const py::buffer& l0_rows, const py::buffer& l1_rows, const py::dict& overflow,
                    const py::object& hashes, const py::buffer& out_ids) {
  py::buffer_info i0, i1, io = out_ids.request(true);
  Level l0 = level_of(l0_rows, false, i0), l1 = level_of(l1_rows, true, i1);
  py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(hashes.ptr(), "hashes must be a sequence"));
  if (!seq) throw py::error_already_set();
  auto n = static_cast<size_t>(PySequence_Fast_GET_SIZE(seq.ptr()));
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  if (io.ndim != 1 || io.itemsize != sizeof(int32_t) || io.strides[0] != sizeof(int32_t) ||
      static_cast<size_t>(io.shape[0]) < n)
    throw py::value_error("out must be a contiguous int32 array with a slot per hash");
  auto* out = static_cast<int32_t*>(io.ptr);
  // Both levels' rows are prefetched kAhead blocks ahead: one block in five lives in level 1, and
  // waiting for level 0 before fetching it would serialise the two misses.
  uint64_t key[2];
  auto fetch = [&](size_t j) {
    if (j < n && key_of(items[j], key)) {
      l0.prefetch(key);
      l1.prefetch(key);
    }
  };
  for (size_t j = 0; j < kAhead; ++j) fetch(j);
  for (size_t b = 0; b < n; ++b) {
    fetch(b + kAhead);
    if (!key_of(items[b], key)) return b;
    int32_t p0 = l0.find(key), p1 = l1.find(key);
    int32_t pid = p0 >= 0 ? p0 : p1;
    if (pid < 0) pid = spilled(overflow, items[b], key);
    if (pid < 0) return b;
    out[b] = pid;
  }
  return n;
}

// --- the host's shared table (kvstore/index/shared_table.py) -------------------------------------
// A worker process probes its host daemon's presence table through a read-only mapping: no round
// trip. The daemon writes it under a sequence lock (odd while a change is under way); a probe
// that saw the sequence move, or the table retired, answers -1 and the caller tries again or asks
// the daemon. Rows are read with plain loads: a torn row is caught by the sequence, never used.
constexpr uint64_t kSharedMagic = 0x313058444948564bULL;  // "KVHIDX01" little-endian
constexpr size_t kSharedHeader = 64;                      // u64: magic, seq, state, heartbeat, slots0..2, flags
constexpr uint64_t kRetired = 1;                          // state bit: a newer table replaced this one
constexpr uint64_t kMaxSlots = uint64_t{1} << 40;

bool power_of_two(uint64_t v) { return v != 0 && v <= kMaxSlots && (v & (v - 1)) == 0; }

py::ssize_t shared_prefix(const py::buffer& table, const py::object& hashes, uint64_t salt0, uint64_t salt1) {
  py::buffer_info info = table.request();
  if (info.ndim != 1 || info.itemsize != 1 || static_cast<size_t>(info.size) < kSharedHeader)
    throw py::value_error("a shared index table must be a byte buffer holding its header");
  const auto* base = static_cast<const uint8_t*>(info.ptr);
  if (reinterpret_cast<uintptr_t>(base) % alignof(uint64_t) != 0)
    throw py::value_error("a shared index table must be 8-byte aligned");
  const auto* header = reinterpret_cast<const uint64_t*>(base);
  uint64_t slots[3];
  std::memcpy(slots, header + 4, sizeof slots);
  if (header[0] != kSharedMagic || !power_of_two(slots[0]) || !power_of_two(slots[1]) || !power_of_two(slots[2]) ||
      kSharedHeader + (slots[0] + slots[1] + slots[2]) * kRowBytes > static_cast<uint64_t>(info.size))
    throw py::value_error("not a shared index table (magic or sizes)");
  Level l0{base + kSharedHeader, slots[0] - 1, false};
  Level l1{l0.rows + slots[0] * kRowBytes, slots[1] - 1, true};
  const uint8_t* spill = l1.rows + slots[1] * kRowBytes;
  const uint64_t spill_mask = slots[2] - 1;

  py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(hashes.ptr(), "hashes must be a sequence"));
  if (!seq) throw py::error_already_set();
  auto n = static_cast<size_t>(PySequence_Fast_GET_SIZE(seq.ptr()));
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());

  uint64_t before = __atomic_load_n(header + 1, __ATOMIC_ACQUIRE);
  if ((before & 1) || (__atomic_load_n(header + 2, __ATOMIC_ACQUIRE) & kRetired)) return -1;
  uint64_t key[2];
  auto salted = [&](size_t j) {
    if (j >= n || !key_of(items[j], key)) return false;
    key[0] ^= salt0;
    key[1] ^= salt1;
    return true;
  };
  for (size_t j = 0; j < kAhead; ++j)
    if (salted(j)) {
      l0.prefetch(key);
      l1.prefetch(key);
    }
  size_t found = n;
  for (size_t b = 0; b < n; ++b) {
    if (salted(b + kAhead)) {
      l0.prefetch(key);
      l1.prefetch(key);
    }
    if (!salted(b)) {
      found = b;
      break;
    }
    if (l0.find(key) >= 0 || l1.find(key) >= 0) continue;
    // The spill level: linear probing from (k0 ^ k1); -1 ends a chain, -2 is a removed entry.
    bool here = false;
    uint64_t slot = (key[0] ^ key[1]) & spill_mask;
    for (uint64_t step = 0; step <= spill_mask; ++step, slot = (slot + 1) & spill_mask) {
      const uint8_t* r = spill + slot * kRowBytes;
      uint64_t k[2];
      int32_t pid;
      std::memcpy(k, r, sizeof k);
      std::memcpy(&pid, r + sizeof k, sizeof pid);
      if (pid == -1) break;
      if (pid >= 0 && k[0] == key[0] && k[1] == key[1]) {
        here = true;
        break;
      }
    }
    if (!here) {
      found = b;
      break;
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  return __atomic_load_n(header + 1, __ATOMIC_RELAXED) == before ? static_cast<py::ssize_t>(found) : -1;
}

}  // namespace

namespace kvt {

void add_index_probe(py::module_& m) {
  m.def("index_prefix", &index_prefix, py::arg("l0"), py::arg("l1"), py::arg("overflow"), py::arg("hashes"),
        py::arg("out"),
        "Index mirror match(): fills out[i] with the placement id of hashes[i] for the leading run of hashes "
        "found in level 0, level 1 or the overflow dict, and returns its length. Holds the GIL.");
  m.def("shared_prefix", &shared_prefix, py::arg("table"), py::arg("hashes"), py::arg("salt0"), py::arg("salt1"),
        "The host's shared index table (kvstore.index.shared_table): how many leading hashes, each XORed with "
        "the fingerprint's salt, it holds; -1 when the table changed under the probe or was retired. Holds the GIL.");
}

}  // namespace kvt
