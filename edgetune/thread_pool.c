/* edgetune's thread pool for TVM's CPU kernels (made by edgetune, shipped in an artifact as threads.so).

   TVM's own pool spins by yielding its core (sched_yield) up to 300,000 times before a waiting thread sleeps:
   beside another busy process every yield hands that process the core, and a kernel waits for the share whose
   core was handed away; with no spinning at all, every parallel loop pays a thread's wake-up instead. Here a
   thread waiting for work spins on the CPU's pause hint for SPIN_NS, keeping its core, then sleeps on a futex;
   and every thread, the caller included, takes the next share no thread has started, so a share is never
   left waiting for a thread the machine descheduled or has not woken yet.

   edgetune_thread_pool_start(model_library, threads) points the loaded model library's parallel launch
   (`__TVMBackendParallelLaunch`, set by TVM's runtime when it loads the library) at this pool. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
  void* sync_handle;
  int32_t num_task;
} TVMParallelGroupEnv;
typedef int (*FTVMParallelLambda)(int task_id, TVMParallelGroupEnv* penv, void* cdata);

#define SPIN_NS 50000L /* between two kernels of one inference a thread waits a few microseconds */
#define MAX_THREADS 256

static int pool_threads = 0;
static _Atomic uint64_t job_state;  /* the job's number << 32 | its next share no thread has taken */
static _Atomic uint32_t wake_word;  /* futex word: changes with every job */
static _Atomic int sleeping, shares_done, failed;
static _Atomic(FTVMParallelLambda) job_lambda; /* written before the job's number, read after it */
static _Atomic(void*) job_data;
static _Atomic int job_shares;
static __thread int inside_pool;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
  __asm__ volatile("yield"); /* the instruction, a hint: not the system call */
#endif
}

static long now_ns(void) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return now.tv_sec * 1000000000L + now.tv_nsec;
}

/* Take and run shares of job `number` while it has shares no thread has taken. The number in the same word
   as the next share keeps a thread that saw an earlier job from taking a later job's share. */
static void run_shares(uint32_t number, FTVMParallelLambda lambda, void* data, int shares) {
  TVMParallelGroupEnv env = {NULL, shares};
  uint64_t seen = atomic_load(&job_state);
  for (;;) {
    if ((uint32_t)(seen >> 32) != number || (int)(uint32_t)seen >= shares) return;
    if (!atomic_compare_exchange_weak(&job_state, &seen, seen + 1)) continue;
    if (lambda((int)(uint32_t)seen, &env, data) != 0) atomic_store(&failed, 1);
    atomic_fetch_add(&shares_done, 1);
    seen = atomic_load(&job_state);
  }
}

static void* worker(void* unused) {
  (void)unused;
  inside_pool = 1;
  uint32_t seen = 0;
  for (;;) {
    long waiting_since = now_ns();
    unsigned spins = 0;
    while (atomic_load(&wake_word) == seen) {
      cpu_relax();
      if ((++spins & 63) == 0 && now_ns() - waiting_since > SPIN_NS) {
        atomic_fetch_add(&sleeping, 1);
        if (atomic_load(&wake_word) == seen) syscall(SYS_futex, &wake_word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        atomic_fetch_sub(&sleeping, 1);
        waiting_since = now_ns();
      }
    }
    seen = atomic_load(&wake_word);
    run_shares((uint32_t)(atomic_load(&job_state) >> 32), job_lambda, job_data, job_shares);
  }
  return NULL;
}

/* TVM's parallel launch: `lambda` run once for each share 0..num_task-1 (num_task 0: one per thread). */
static int parallel_launch(FTVMParallelLambda lambda, void* data, int num_task) {
  int shares = num_task > 0 ? num_task : pool_threads;
  if (inside_pool || pool_threads == 1 || shares == 1) { /* a launch inside a share runs on its thread */
    TVMParallelGroupEnv env = {NULL, shares};
    for (int share = 0; share < shares; ++share)
      if (lambda(share, &env, data) != 0) return -1;
    return 0;
  }
  job_lambda = lambda;
  job_data = data;
  job_shares = shares;
  atomic_store(&failed, 0);
  atomic_store(&shares_done, 0);
  uint32_t number = (uint32_t)(atomic_load(&job_state) >> 32) + 1;
  atomic_store(&job_state, (uint64_t)number << 32);
  atomic_fetch_add(&wake_word, 1);
  if (atomic_load(&sleeping) > 0) syscall(SYS_futex, &wake_word, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
  inside_pool = 1;
  run_shares(number, lambda, data, shares);
  inside_pool = 0;
  while (atomic_load(&shares_done) != shares) cpu_relax();
  return atomic_load(&failed) ? -1 : 0;
}

/* 0 (also for a library with no parallel loop), or why not: -1 the library is not loaded, -3 it synchronises
   its shares (TVM's parallel barrier, which this pool does not give), -4 `threads` is not 1..MAX_THREADS or
   differs from the pool's, -5 a thread could not start. */
int edgetune_thread_pool_start(const char* model_library, int threads) {
  void* library = dlopen(model_library, RTLD_NOW | RTLD_NOLOAD);
  if (library == NULL) return -1;
  void** launch = (void**)dlsym(library, "__TVMBackendParallelLaunch");
  int barrier = dlsym(library, "__TVMBackendParallelBarrier") != NULL;
  dlclose(library); /* TVM's own handle keeps it loaded */
  if (launch == NULL) return 0; /* no parallel loop: nothing to run here */
  if (barrier) return -3;
  if (threads < 1 || threads > MAX_THREADS || (pool_threads != 0 && threads != pool_threads)) return -4;
  if (pool_threads == 0) {
    for (int started = 1; started < threads; ++started) {
      pthread_t thread;
      if (pthread_create(&thread, NULL, worker, NULL) != 0) return -5;
      pthread_detach(thread);
    }
    pool_threads = threads;
  }
  *launch = (void*)parallel_launch;
  return 0;
}
