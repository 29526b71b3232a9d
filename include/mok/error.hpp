// mok::Error and status codes shared by the C++ and C APIs.
#pragma once

#include <stdexcept>
#include <string>

namespace mok {

// Status codes; the C API returns the same numbers (mok_status_t).
enum class Status : int {
  kOk = 0,
  kInvalidArgument = 1,   // a shape, knob, pointer or routing input is wrong
  kCapacityOverflow = 2,  // more routed rows landed on a rank than the capacity allows
  kNotImplemented = 3,    // the entry point exists in the API but not yet on this engine
  kCudaError = 4,
  kNcclError = 5,
  kTimeout = 6,           // an in-kernel wait exceeded its timeout (peer dead or a bug)
  kInternal = 7,
};

const char* status_name(Status s) noexcept;

// Every failure in mok is reported as this exception (C++ API) or as a status plus
// mok_last_error() text (C API). The message names the argument and what was expected.
class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  Status status() const noexcept { return status_; }

 private:
  Status status_;
};

// Throws Error(kInvalidArgument, "<argument>: <expected>, got <got>").
[[noreturn]] void throw_invalid(const std::string& argument, const std::string& expected,
                                const std::string& got);

}  // namespace mok
