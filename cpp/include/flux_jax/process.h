// Process-level identity of this JAX process, set from Python (flux_jax/_lowering.py)
// before a fused op runs: which process it is, the session token shared by the
// processes of one job (jax.distributed), and how local device ordinals (what an
// FFI handler sees) map to global device ids (what the mesh table holds).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace flux_jax {

enum class Platform : int { kCpu = 0, kCuda = 1 };

void SetProcessIdentity(int process_index, const std::string& session);
void RegisterLocalDevices(Platform platform, const std::vector<std::pair<int32_t, int64_t>>& ordinal_to_id);

int ProcessIndex();
std::string Session();  // "" in a single-process job

// Global id of a local device; the ordinal itself if nothing was registered.
int64_t GlobalDeviceId(Platform platform, int32_t ordinal);
// Local ordinal of a global id in this process, or -1.
int32_t LocalOrdinal(Platform platform, int64_t global_id);

}  // namespace flux_jax
