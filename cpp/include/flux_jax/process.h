// Process-level identity of this JAX process, set from Python (flux_jax/_distributed.py)
// before a fused op runs: which process it is, the job token and the
// shared-memory secret of the job (both shared by its processes through
// jax.distributed's key-value store), and how local device ordinals (what an FFI
// handler sees) map to global device ids (what the mesh table holds).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace flux_jax {

enum class Platform : int { kCpu = 0, kCuda = 1 };

// `identity` is "" (a single-process job) or "<session>/<secret>": the session
// token (it may appear in names others can see) and the job's secret, >= 32 hex
// digits, which never appears in a name (channel.cc derives segment names from it
// with a keyed hash). One string because the extension's binding takes one.
void SetProcessIdentity(int process_index, const std::string& identity);
void RegisterLocalDevices(Platform platform, const std::vector<std::pair<int32_t, int64_t>>& ordinal_to_id);

int ProcessIndex();
std::string Session();    // "" in a single-process job
std::string ShmSecret();  // the secret's bytes; "" if none was set (or it was malformed)

// Global id of a local device; the ordinal itself if nothing was registered.
int64_t GlobalDeviceId(Platform platform, int32_t ordinal);
// Local ordinal of a global id in this process, or -1.
int32_t LocalOrdinal(Platform platform, int64_t global_id);

}  // namespace flux_jax
