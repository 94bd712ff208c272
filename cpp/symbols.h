// Calls resolved at run time from a library Python already loaded (ucxx's libucp, python-xxhash's
// extension): the data path calls the very copy Python uses, and the module links against neither.
#pragma once

#include <dlfcn.h>

#include <string>

namespace kvt {

class Symbols {
 public:
  explicit Symbols(const std::string& path) : path_(path), lib_(::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) {
    if (!lib_) error_ = "dlopen " + path + ": " + ::dlerror();
  }

  // `fn` = the symbol `name`, or nullptr (remembered for error()).
  template <typename Fn>
  void resolve(Fn& fn, const char* name) {
    fn = lib_ ? reinterpret_cast<Fn>(::dlsym(lib_, name)) : nullptr;
    if (lib_ && !fn) missing_ += (missing_.empty() ? "" : ", ") + std::string(name);
  }

  // Empty once the library opened and every symbol resolved; else why not.
  std::string error() const {
    if (!lib_) return error_;
    return missing_.empty() ? "" : path_ + " lacks " + missing_;
  }

 private:
  std::string path_;
  void* lib_;  // never closed: the resolved calls stay in use for the life of the process
  std::string error_, missing_;
};

}  // namespace kvt
