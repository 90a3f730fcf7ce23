#include "flux_jax/process.h"

#include <map>
#include <mutex>

namespace flux_jax {
namespace {

struct Identity {
  std::mutex mu;
  int process_index = 0;
  std::string session;
  std::string secret;  // raw bytes
  std::map<int32_t, int64_t> to_global[2];
  std::map<int64_t, int32_t> to_local[2];
};

Identity& State() {
  static auto* state = new Identity();
  return *state;
}

// Hex digits -> bytes; "" if `hex` is not an even number (>= 32) of hex digits.
std::string DecodeSecret(const std::string& hex) {
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (hex.size() < 32 || hex.size() % 2 != 0) return "";
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return "";
    out[i] = static_cast<char>(hi << 4 | lo);
  }
  return out;
}

}  // namespace

void SetProcessIdentity(int process_index, const std::string& identity) {
  Identity& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  s.process_index = process_index;
  const size_t slash = identity.find('/');
  s.session = identity.substr(0, slash);
  s.secret = slash == std::string::npos ? "" : DecodeSecret(identity.substr(slash + 1));
}

void RegisterLocalDevices(Platform platform, const std::vector<std::pair<int32_t, int64_t>>& pairs) {
  Identity& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  const int p = static_cast<int>(platform);
  for (const auto& [ordinal, id] : pairs) {
    s.to_global[p][ordinal] = id;
    s.to_local[p][id] = ordinal;
  }
}

int ProcessIndex() {
  Identity& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.process_index;
}

std::string Session() {
  Identity& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.session;
}

std::string ShmSecret() {
  Identity& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.secret;
}

int64_t GlobalDeviceId(Platform platform, int32_t ordinal) {
  Identity& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  const auto& m = s.to_global[static_cast<int>(platform)];
  auto it = m.find(ordinal);
  return it == m.end() ? ordinal : it->second;
}

int32_t LocalOrdinal(Platform platform, int64_t global_id) {
  Identity& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  const auto& m = s.to_local[static_cast<int>(platform)];
  auto it = m.find(global_id);
  if (it != m.end()) return it->second;
  return m.empty() ? static_cast<int32_t>(global_id) : -1;
}

}  // namespace flux_jax
