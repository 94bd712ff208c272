// Block checksums (kvstore/integrity.py): xxh3-64 of many blocks with the GIL released, spread over
// a few threads. The hash itself is the one python-xxhash ships (resolved with dlsym), so native and
// Python checksums are the same function by construction.
#pragma once

#include <pybind11/pybind11.h>

namespace kvt {

void add_checksum(pybind11::module_& m);

}  // namespace kvt
