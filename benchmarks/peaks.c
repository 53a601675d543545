/* This CPU's arithmetic peaks and read bandwidth on every core, for the benchmarks' "% of peak" and
 * "% of bandwidth" figures (benchmarks/harness.py: arithmetic_peaks, read_bandwidth).
 *
 * One source, compiled at benchmark run time once per probe into its own library, each with only the
 * flags its instructions need (harness.py picks the probes this CPU's /proc/cpuinfo flags allow, so a
 * CPU without an instruction set never runs its code):
 *   -DPROBE_AVX512 -mavx512f -mfma    float32 FMA on zmm (16 independent accumulators); read loop
 *   -DPROBE_AVX2 -mavx2 -mfma         float32 FMA on ymm (12 independent accumulators); read loop
 *   -DPROBE_GENERIC                   float32 multiply then add on SSE2 / scalar lanes (32 independent
 *                                     lanes, no FMA: counted as 2 FLOP a multiply-add); read loop
 *   -DPROBE_BF16 -mavx512f -mavx512bw -mavx512bf16
 *                                     bfloat16 dot products, vdpbf16ps zmm (16 accumulators; 64 FLOP each)
 *   -DPROBE_AMX -mamx-tile -mamx-bf16 bfloat16 AMX tiles, tdpbf16ps 16x16x32 (4 accumulator tiles;
 *                                     16384 FLOP each), after the kernel's permission (arch_prctl)
 *
 * Every probe runs one thread per CPU of the process's affinity mask, each pinned to its CPU and running
 * its own loop for a fixed duration; the result is the sum of the threads' rates (FLOP/s) or the bytes
 * of all slices over the slowest thread's time (read bandwidth). Negative results are errors. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(PROBE_AVX512) || defined(PROBE_AVX2) || defined(PROBE_BF16) || defined(PROBE_AMX)
#include <immintrin.h>
#endif
#if defined(PROBE_AMX)
#include <sys/syscall.h>
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

volatile float peaks_sink; /* results land here, so no loop is optimised away */

/* ---- the compute kernels: chunk(iters) runs iters iterations and returns the FLOP it did ---- */

#define REP4(X, a, b, c, d) X(a) X(b) X(c) X(d)
#define REP8(X) REP4(X, 0, 1, 2, 3) REP4(X, 4, 5, 6, 7)
#define REP12(X) REP8(X) REP4(X, 8, 9, 10, 11)
#define REP16(X) REP12(X) REP4(X, 12, 13, 14, 15)

#if defined(PROBE_AVX512)
static const char kernel_name[] = "float32 FMA, zmm (AVX-512), 16 accumulators";
static double chunk(long iters) {
#define DECL(i) __m512 c##i = _mm512_set1_ps(0.01f * (i));
#define STEP(i) c##i = _mm512_fmadd_ps(c##i, a, b);
#define SUM(i) s = _mm512_add_ps(s, c##i);
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-6f);
    REP16(DECL)
    for (long n = 0; n < iters; n++) { REP16(STEP) }
    __m512 s = _mm512_setzero_ps();
    REP16(SUM)
    peaks_sink = _mm512_reduce_add_ps(s);
    return (double)iters * 16 * 16 * 2;
#undef DECL
#undef STEP
#undef SUM
}
#elif defined(PROBE_AVX2)
static const char kernel_name[] = "float32 FMA, ymm (AVX2), 12 accumulators";
static double chunk(long iters) {
#define DECL(i) __m256 c##i = _mm256_set1_ps(0.01f * (i));
#define STEP(i) c##i = _mm256_fmadd_ps(c##i, a, b);
#define SUM(i) s = _mm256_add_ps(s, c##i);
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-6f);
    REP12(DECL)
    for (long n = 0; n < iters; n++) { REP12(STEP) }
    __m256 s = _mm256_setzero_ps();
    REP12(SUM)
    float out[8];
    _mm256_storeu_ps(out, s);
    peaks_sink = out[0] + out[7];
    return (double)iters * 12 * 8 * 2;
#undef DECL
#undef STEP
#undef SUM
}
#elif defined(PROBE_GENERIC)
static const char kernel_name[] = "float32 multiply + add, 32 independent lanes (SSE2 or scalar, no FMA)";
static double chunk(long iters) {
    float c[32];
    const float a = 0.999999f, b = 1e-6f;
    for (int j = 0; j < 32; j++) c[j] = 0.01f * (float)j;
    for (long n = 0; n < iters; n++)
        for (int j = 0; j < 32; j++) c[j] = c[j] * a + b; /* -ffp-contract=off: no FMA */
    float s = 0;
    for (int j = 0; j < 32; j++) s += c[j];
    peaks_sink = s;
    return (double)iters * 32 * 2;
}
#elif defined(PROBE_BF16)
static const char kernel_name[] = "bfloat16 dot products, vdpbf16ps zmm (AVX512_BF16), 16 accumulators";
static double chunk(long iters) {
#define DECL(i) __m512 c##i = _mm512_set1_ps(0.01f * (i)); /* distinct: equal ones would be merged */
#define STEP(i) c##i = _mm512_dpbf16_ps(c##i, a, b);
#define SUM(i) s = _mm512_add_ps(s, c##i);
    const __m512 x = _mm512_set1_ps(1.0f / 1024), y = _mm512_set1_ps(1.0f / 512);
    const __m512bh a = _mm512_cvtne2ps_pbh(x, x), b = _mm512_cvtne2ps_pbh(y, y);
    REP16(DECL)
    for (long n = 0; n < iters; n++) { REP16(STEP) }
    __m512 s = _mm512_setzero_ps();
    REP16(SUM)
    peaks_sink = _mm512_reduce_add_ps(s);
    return (double)iters * 16 * 16 * 2 * 2; /* 16 lanes x 2 products x (multiply + add) */
#undef DECL
#undef STEP
#undef SUM
}
#elif defined(PROBE_AMX)
static const char kernel_name[] = "bfloat16 AMX tiles, tdpbf16ps 16x16x32, 4 accumulator tiles";
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static double chunk(long iters) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    static __thread uint16_t ab[16 * 32] __attribute__((aligned(64)));
    static __thread float out[16 * 16] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 32; i++) ab[i] = 0x3A80; /* 1/1024 in bfloat16 */
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, ab, 64); _tile_loadd(5, ab, 64); _tile_loadd(6, ab, 64); _tile_loadd(7, ab, 64);
    for (long n = 0; n < iters; n++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out, 64);
    peaks_sink = out[0];
    _tile_stored(3, out, 64);
    peaks_sink += out[255];
    _tile_release();
    return (double)iters * 4 * 16 * 16 * 32 * 2;
}
#else
#error "compile with one of -DPROBE_AVX512, -DPROBE_AVX2, -DPROBE_GENERIC, -DPROBE_BF16, -DPROBE_AMX"
#endif

const char *peaks_kernel(void) { return kernel_name; }

/* ---- threads: one per CPU of the affinity mask, pinned, started together ---- */

typedef struct gate gate_t;
typedef struct {
    int cpu;
    gate_t *gate;
    double seconds;         /* compute: how long to run */
    const float *data;      /* read: this thread's slice */
    size_t count;           /* read: its length in floats */
    double flop, start, end;
} job_t;

/* Threads wait at the gate until every one of them exists (open: 1), or leave if one could not be
 * created (open: -1): a barrier would leave the created ones waiting forever. */
struct gate {
    pthread_mutex_t lock;
    pthread_cond_t opened;
    int open;
};

static int wait_gate(gate_t *gate) {
    pthread_mutex_lock(&gate->lock);
    while (gate->open == 0) pthread_cond_wait(&gate->opened, &gate->lock);
    int open = gate->open;
    pthread_mutex_unlock(&gate->lock);
    return open > 0;
}

static int affinity_cpus(int *cpus, int max) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return -1;
    int n = 0;
    for (int c = 0; c < CPU_SETSIZE && n < max; c++)
        if (CPU_ISSET(c, &set)) cpus[n++] = c;
    return n;
}

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set); /* best effort */
}

/* body(&jobs[i]) on `threads` threads, released together; 0, or -2 if a thread could not be created. */
static int run_threads(int threads, void *(*body)(void *), job_t *jobs) {
    pthread_t ids[1024];
    gate_t gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
    int started = 0;
    for (int i = 0; i < threads; i++) {
        jobs[i].gate = &gate;
        if (pthread_create(&ids[i], NULL, body, &jobs[i]) != 0) break;
        started++;
    }
    pthread_mutex_lock(&gate.lock);
    gate.open = started == threads ? 1 : -1;
    pthread_cond_broadcast(&gate.opened);
    pthread_mutex_unlock(&gate.lock);
    for (int i = 0; i < started; i++) pthread_join(ids[i], NULL);
    return started == threads ? 0 : -2;
}

static void *compute_body(void *arg) {
    job_t *job = arg;
    pin(job->cpu);
    if (!wait_gate(job->gate)) return NULL;
    chunk(1000); /* warm up (AVX-512 / AMX power state) */
    double start = now(), t = start, flop = 0;
    long iters = 2000;
    while (t - start < job->seconds) {
        flop += chunk(iters);
        double t2 = now();
        if (t2 - t < 1e-3 && iters < (1L << 30)) iters *= 2; /* chunks of about a millisecond or more */
        t = t2;
    }
    job->flop = flop, job->start = start, job->end = t;
    return NULL;
}

/* FLOP/s of all threads running the kernel for `seconds` (the sum of each thread's rate); < 0 on error. */
double peaks_compute(int threads, double seconds) {
    int cpus[1024];
    int n = affinity_cpus(cpus, 1024);
    if (n <= 0) return -1;
    if (threads <= 0 || threads > n) threads = n;
#if defined(PROBE_AMX)
    /* Linux hands out the AMX tile data state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). */
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return -3;
#endif
    job_t jobs[1024];
    for (int i = 0; i < threads; i++) {
        memset(&jobs[i], 0, sizeof jobs[i]);
        jobs[i].cpu = cpus[i], jobs[i].seconds = seconds;
    }
    int status = run_threads(threads, compute_body, jobs);
    if (status != 0) return status;
    double rate = 0;
    for (int i = 0; i < threads; i++) rate += jobs[i].flop / (jobs[i].end - jobs[i].start);
    return rate;
}

/* ---- read bandwidth ---- */

static float read_slice(const float *p, size_t count) {
    float acc[64] = {0}; /* 64 independent lanes: the compiler vectorises them with this build's vectors */
    size_t i = 0;
    for (; i + 64 <= count; i += 64)
        for (int j = 0; j < 64; j++) acc[j] += p[i + j];
    for (; i < count; i++) acc[0] += p[i];
    float s = 0;
    for (int j = 0; j < 64; j++) s += acc[j];
    return s;
}

static void *touch_body(void *arg) {
    job_t *job = arg;
    pin(job->cpu);
    if (!wait_gate(job->gate)) return NULL;
    float *p = (float *)job->data;
    for (size_t i = 0; i < job->count; i++) p[i] = 1.0f; /* first touch by the thread that reads it */
    return NULL;
}

static void *read_body(void *arg) {
    job_t *job = arg;
    pin(job->cpu);
    if (!wait_gate(job->gate)) return NULL;
    job->start = now();
    peaks_sink = read_slice(job->data, job->count);
    job->end = now();
    return NULL;
}

/* Bytes per second read by all threads, each its own slice of a `bytes` buffer, for each of `repeats`
 * passes (written to rates[]); returns the best, < 0 on error. */
double peaks_read(int threads, size_t bytes, int repeats, double *rates) {
    int cpus[1024];
    int n = affinity_cpus(cpus, 1024);
    if (n <= 0) return -1;
    if (threads <= 0 || threads > n) threads = n;
    size_t count = bytes / sizeof(float) / (size_t)threads / 64 * 64;
    if (count == 0) return -1;
    float *buffer = NULL;
    if (posix_memalign((void **)&buffer, 2 << 20, count * (size_t)threads * sizeof(float)) != 0) return -4;
    job_t jobs[1024];
    for (int i = 0; i < threads; i++) {
        memset(&jobs[i], 0, sizeof jobs[i]);
        jobs[i].cpu = cpus[i], jobs[i].data = buffer + (size_t)i * count, jobs[i].count = count;
    }
    double best = -2;
    int status = run_threads(threads, touch_body, jobs);
    for (int r = 0; status == 0 && r < repeats; r++) {
        status = run_threads(threads, read_body, jobs);
        double start = jobs[0].start, end = jobs[0].end;
        for (int i = 1; i < threads; i++) {
            if (jobs[i].start < start) start = jobs[i].start;
            if (jobs[i].end > end) end = jobs[i].end;
        }
        double rate = (double)(count * (size_t)threads * sizeof(float)) / (end - start);
        if (rates) rates[r] = rate;
        if (rate > best) best = rate;
    }
    free(buffer);
    return status != 0 ? status : best;
}
