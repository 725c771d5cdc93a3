/* How far apart two CPUs are, as the round trip of one cache line between them (benchmarks/placement.py).

   On the 2-core VMs these benchmarks run on, the hypervisor places the two virtual CPUs in one core complex
   (a round trip of about 50 ns) for a while, then apart (about 330 ns, no shared L3), then together again. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

static _Atomic long turn __attribute__((aligned(64)));
static _Atomic int unpinned;
static long trips;
static int answering_cpu;

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0) atomic_store(&unpinned, 1);
}

static void* answer(void* unused) {
  (void)unused;
  pin(answering_cpu); /* unpinned or not, it answers every trip: the caller waits for each */
  for (long i = 0; i < trips; ++i) {
    while (atomic_load(&turn) != 2 * i + 1) {
    }
    atomic_store(&turn, 2 * i + 2);
  }
  return NULL;
}

/* Nanoseconds per round trip between `cpu_a` and `cpu_b` (the calling thread pinned on the first for the
   while, a thread of its own on the second), or -1 where a thread could not start or be pinned. */
double core_round_trip_ns(int cpu_a, int cpu_b, long round_trips) {
  cpu_set_t callers;
  if (pthread_getaffinity_np(pthread_self(), sizeof callers, &callers) != 0) return -1;
  pthread_t other;
  atomic_store(&turn, 0);
  atomic_store(&unpinned, 0);
  trips = round_trips;
  answering_cpu = cpu_b;
  if (pthread_create(&other, NULL, answer, NULL) != 0) return -1;
  pin(cpu_a);
  struct timespec begin, end;
  clock_gettime(CLOCK_MONOTONIC, &begin);
  for (long i = 0; i < round_trips; ++i) {
    atomic_store(&turn, 2 * i + 1);
    while (atomic_load(&turn) != 2 * i + 2) {
    }
  }
  clock_gettime(CLOCK_MONOTONIC, &end);
  pthread_join(other, NULL);
  pthread_setaffinity_np(pthread_self(), sizeof callers, &callers);
  if (atomic_load(&unpinned)) return -1;
  return ((end.tv_sec - begin.tv_sec) * 1e9 + (end.tv_nsec - begin.tv_nsec)) / round_trips;
}
