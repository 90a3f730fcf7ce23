// LD_PRELOAD shim for test_multiprocess.py: the process stops itself (SIGSTOP) right after
// it acquired its Nth process-shared pthread mutex, i.e. while holding a lock that lives in
// shared memory, as if the scheduler or a debugger had stopped it there. N comes from
// FLUX_TEST_STOP_AFTER_SHARED_LOCKS (test-only; flux_jax itself reads no such variable).
// A channel with no shared locks never triggers it; the test then stops the process itself.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>

static int (*real_lock)(pthread_mutex_t*);
static atomic_long shared_locks;
static long stop_after = -1;

__attribute__((constructor)) static void init(void) {
  real_lock = (int (*)(pthread_mutex_t*))dlsym(RTLD_NEXT, "pthread_mutex_lock");
  const char* n = getenv("FLUX_TEST_STOP_AFTER_SHARED_LOCKS");
  stop_after = n ? atol(n) : -1;
}

int pthread_mutex_lock(pthread_mutex_t* mu) {
  if (!real_lock) real_lock = (int (*)(pthread_mutex_t*))dlsym(RTLD_NEXT, "pthread_mutex_lock");
  int rc = real_lock(mu);
  // glibc: bit 7 of __kind is PTHREAD_MUTEX_PSHARED_BIT
  if (stop_after >= 0 && (mu->__data.__kind & 128) && atomic_fetch_add(&shared_locks, 1) == stop_after) {
    raise(SIGSTOP);
  }
  return rc;
}
