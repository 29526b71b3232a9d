// Small shared pieces of the `mok` program: option parsing and the subcommands.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace mok::cli {

// "--name value" / "--name=value" / "--flag" options after the subcommand.
class Options {
 public:
  Options(const std::vector<std::string>& args, const std::map<std::string, std::string>& defaults);
  std::string str(const std::string& name) const;
  int64_t integer(const std::string& name, int64_t lo, int64_t hi) const;
  double real(const std::string& name, double lo, double hi) const;

 private:
  std::map<std::string, std::string> values_;
};

int run_demo(const Options& opts);
int run_info();
int run_bench(const Options& opts);
int run_soak(const Options& opts);

}  // namespace mok::cli
