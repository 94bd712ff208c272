// match() of the index mirror (kvstore/index_table.py): the leading run of a prompt's block
// hashes found in its two-level hash index.
#pragma once

#include <pybind11/pybind11.h>

namespace kvt {

void add_index_probe(pybind11::module_& m);

}  // namespace kvt
