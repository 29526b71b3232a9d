#include "mok/error.hpp"

namespace mok {

const char* status_name(Status s) noexcept {
  switch (s) {
    case Status::kOk: return "ok";
    case Status::kInvalidArgument: return "invalid argument";
    case Status::kCapacityOverflow: return "capacity overflow";
    case Status::kNotImplemented: return "not implemented";
    case Status::kCudaError: return "CUDA error";
    case Status::kNcclError: return "NCCL error";
    case Status::kTimeout: return "timeout";
    case Status::kInternal: return "internal error";
  }
  return "unknown status";
}

void throw_invalid(const std::string& argument, const std::string& expected, const std::string& got) {
  throw Error(Status::kInvalidArgument, argument + ": expected " + expected + ", got " + got);
}

}  // namespace mok
