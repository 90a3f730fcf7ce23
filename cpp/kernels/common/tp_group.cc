#include "flux_jax/tp_group.h"

#include <sstream>

namespace flux_jax {

std::string TpGroup::Describe() const {
  std::ostringstream os;
  os << "TP group " << group_index << " [devices ";
  for (size_t i = 0; i < devices.size(); ++i) os << (i ? "," : "") << devices[i];
  if (cross_process) {
    os << " in processes ";
    for (size_t i = 0; i < processes.size(); ++i) os << (i ? "," : "") << processes[i];
  }
  os << "]";
  return os.str();
}

Status ResolveTpGroup(const int64_t* table, const int64_t* processes, size_t table_size, int64_t tp_size,
                      Platform platform, int32_t device_ordinal, std::optional<int32_t> position_operand,
                      TpGroup* group) {
  if (tp_size < 1 || tp_size > 64) {
    return Status::InvalidArgument("tp_size must be in [1, 64], got " + std::to_string(tp_size));
  }
  if (table_size == 0 || table_size % tp_size != 0) {
    return Status::InvalidArgument("device table of size " + std::to_string(table_size) +
                                   " is not a multiple of tp_size " + std::to_string(tp_size));
  }
  const int64_t my_id = GlobalDeviceId(platform, device_ordinal);
  int64_t found = -1;
  for (size_t i = 0; i < table_size; ++i) {
    if (table[i] != my_id) continue;
    if (found >= 0) {
      return Status::InvalidArgument("device " + std::to_string(my_id) + " appears twice in the TP device table");
    }
    found = static_cast<int64_t>(i);
  }
  if (found < 0) {
    return Status::InvalidArgument(
        "device " + std::to_string(my_id) + " (local ordinal " + std::to_string(device_ordinal) +
        ") is not in the TP device table of this op; was the program compiled for another mesh?");
  }
  group->size = static_cast<int>(tp_size);
  group->rank = static_cast<int>(found % tp_size);
  group->group_index = found / tp_size;
  const int64_t first = group->group_index * tp_size;
  group->devices.assign(table + first, table + first + tp_size);
  group->processes.assign(processes + first, processes + first + tp_size);
  group->ordinals.assign(tp_size, -1);
  group->cross_process = false;
  const int me = ProcessIndex();
  for (int r = 0; r < tp_size; ++r) {
    if (group->processes[r] == me) {
      group->ordinals[r] = LocalOrdinal(platform, group->devices[r]);
    } else {
      group->cross_process = true;
    }
  }
  if (position_operand.has_value() && *position_operand != found) {
    const int64_t rank = *position_operand % tp_size, group_index = *position_operand / tp_size;
    if (rank != group->rank) {
      return Status::InvalidArgument("lax.axis_index says rank " + std::to_string(rank) + " but device " +
                                     std::to_string(my_id) + " sits at rank " + std::to_string(group->rank) + " of " +
                                     group->Describe() + " in the mesh table");
    }
    return Status::InvalidArgument("lax.axis_index over the other mesh axes puts device " + std::to_string(my_id) +
                                   " in TP group " + std::to_string(group_index) + " but the mesh table has it in " +
                                   group->Describe() +
                                   ": the program runs on its devices grouped otherwise than it was lowered for");
  }
  return Status::Ok();
}

}  // namespace flux_jax
