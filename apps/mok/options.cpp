#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "cli.hpp"
#include "mok/error.hpp"

namespace mok::cli {

Options::Options(const std::vector<std::string>& args, const std::map<std::string, std::string>& defaults)
    : values_(defaults) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) throw_invalid("option '" + a + "'", "an option of the form --name value", a);
    std::string name = a.substr(2), value;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      throw_invalid("--" + name, "a value after the option", "nothing");
    }
    if (!values_.count(name)) {
      std::string known;
      for (const auto& [k, v] : values_) known += (known.empty() ? "--" : ", --") + k;
      throw_invalid("--" + name, "one of " + known, "--" + name);
    }
    values_[name] = value;
  }
}

std::string Options::str(const std::string& name) const { return values_.at(name); }

int64_t Options::integer(const std::string& name, int64_t lo, int64_t hi) const {
  const std::string& s = values_.at(name);
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno || end == s.c_str() || *end != '\0' || v < lo || v > hi) {
    throw_invalid("--" + name, "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]", s);
  }
  return v;
}

namespace {
std::string short_number(double v) {  // 0, 60000, 0.006: the range as a user would write it
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
}  // namespace

double Options::real(const std::string& name, double lo, double hi) const {
  const std::string& s = values_.at(name);
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || *end != '\0' || !std::isfinite(v) || v < lo || v > hi) {
    throw_invalid("--" + name, "a number in [" + short_number(lo) + ", " + short_number(hi) + "]", s);
  }
  return v;
}

}  // namespace mok::cli
