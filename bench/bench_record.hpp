// The envelope every recorded benchmark run uses (bench/results/*.json, docs/perf-log.md):
// {"date", "commit", "gpu", "gpus", "command", "results": [...]}. The commit comes from
// MOK_COMMIT (the GPU scripts set it: the device machine's copy of the tree has no .git).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <ctime>
#include <sstream>
#include <string>

namespace mok::bench {

inline std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o;
}

inline std::string command_line(int argc, char** argv) {
  std::string c;
  for (int i = 0; i < argc; ++i) c += (i ? " " : "") + std::string(argv[i]);
  return c;
}

// results_array: a JSON array text of {"bench","shape","ep","metrics":{...}} objects.
inline std::string record_envelope(const std::string& command, const std::string& results_array) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  cudaDeviceProp prop{};
  if (gpus > 0) cudaGetDeviceProperties(&prop, 0);
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  const char* commit = std::getenv("MOK_COMMIT");
  std::ostringstream j;
  j << "{\n \"date\": \"" << date << "\",\n \"commit\": \"" << json_escape(commit ? commit : "unknown")
    << "\",\n \"gpu\": \"" << json_escape(gpus > 0 ? prop.name : "none") << "\",\n \"gpus\": " << gpus
    << ",\n \"command\": \"" << json_escape(command) << "\",\n \"results\": " << results_array << "\n}\n";
  return j.str();
}

}  // namespace mok::bench
