// Shape checks shared by every backend (the Python layer checks first; these
// guard the C++ API against direct misuse and against layout surprises).
#include <string>

#include "flux_jax/ag_matmul.h"
#include "flux_jax/collectives.h"
#include "flux_jax/matmul_ar.h"
#include "flux_jax/matmul_rs.h"

namespace flux_jax {

Status AgMatmulCanImplement(const AgMatmulParams& p, const TpGroup& group) {
  if (p.m_local < 0 || p.k <= 0 || p.n <= 0) {
    return Status::InvalidArgument("ag_matmul: bad shape m_local=" + std::to_string(p.m_local) +
                                   " k=" + std::to_string(p.k) + " n=" + std::to_string(p.n));
  }
  if (group.size < 1) return Status::InvalidArgument("ag_matmul: empty TP group");
  return Status::Ok();
}

Status MatmulRsCanImplement(const MatmulRsParams& p, const TpGroup& group) {
  if (p.m < 0 || p.k <= 0 || p.n <= 0) {
    return Status::InvalidArgument("matmul_rs: bad shape m=" + std::to_string(p.m) + " k=" + std::to_string(p.k) +
                                   " n=" + std::to_string(p.n));
  }
  if (group.size < 1 || p.m % group.size != 0) {
    return Status::InvalidArgument("matmul_rs: rows " + std::to_string(p.m) + " not divisible by TP size " +
                                   std::to_string(group.size));
  }
  return Status::Ok();
}

Status AllGatherCanImplement(const CollectiveParams& p, const TpGroup& group) {
  if (p.rows < 0 || p.cols <= 0) {
    return Status::InvalidArgument("all_gather: bad shape rows=" + std::to_string(p.rows) +
                                   " cols=" + std::to_string(p.cols));
  }
  if (group.size < 1) return Status::InvalidArgument("all_gather: empty TP group");
  return Status::Ok();
}

Status ReduceScatterCanImplement(const CollectiveParams& p, const TpGroup& group) {
  if (p.rows < 0 || p.cols <= 0) {
    return Status::InvalidArgument("reduce_scatter: bad shape rows=" + std::to_string(p.rows) +
                                   " cols=" + std::to_string(p.cols));
  }
  if (DTypeBytes(p.dtype) == 1) {
    return Status::InvalidArgument("reduce_scatter: sums float32, bfloat16 or float16, not a 1-byte payload");
  }
  if (group.size < 1 || p.rows % group.size != 0) {
    return Status::InvalidArgument("reduce_scatter: rows " + std::to_string(p.rows) + " not divisible by TP size " +
                                   std::to_string(group.size));
  }
  return Status::Ok();
}

Status MatmulArCanImplement(const MatmulArParams& p, const TpGroup& group) {
  if (p.m < 0 || p.k <= 0 || p.n <= 0) {
    return Status::InvalidArgument("matmul_ar: bad shape m=" + std::to_string(p.m) + " k=" + std::to_string(p.k) +
                                   " n=" + std::to_string(p.n));
  }
  if (group.size < 1) return Status::InvalidArgument("matmul_ar: empty TP group");
  return Status::Ok();
}

Status AllReduceCanImplement(const CollectiveParams& p, const TpGroup& group) {
  if (p.rows < 0 || p.cols <= 0) {
    return Status::InvalidArgument("all_reduce: bad shape rows=" + std::to_string(p.rows) +
                                   " cols=" + std::to_string(p.cols));
  }
  if (group.size < 1) return Status::InvalidArgument("all_reduce: empty TP group");
  return Status::Ok();
}

}  // namespace flux_jax
