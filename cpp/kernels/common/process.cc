#include "flux_jax/process.h"

#include <map>
#include <mutex>

namespace flux_jax {
namespace {

struct Identity {
  std::mutex mu;
  int process_index = 0;
  std::string session;
  std::map<int32_t, int64_t> to_global[2];
  std::map<int64_t, int32_t> to_local[2];
};

Identity& State() {
  static auto* state = new Identity();
  return *state;
}

}  // namespace

void SetProcessIdentity(int process_index, const std::string& session) {
  Identity& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  s.process_index = process_index;
  s.session = session;
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
